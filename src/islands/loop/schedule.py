"""Learning-rate schedules as plain functions of the step: factor(step) multiplies each parameter group's
initial learning rate. A torch LRScheduler works too (the Trainer steps it once per step)."""

from __future__ import annotations

import math


class WarmupCosine:
    """Linear warm-up over `warmup` steps, then cosine decay to `min_ratio` of the peak at `total` steps
    (the built-in tasks' schedule; post-local SGD switches where its decay starts, SOTA-216)."""

    def __init__(self, warmup: int, total: int, min_ratio: float = 0.1):
        if warmup < 0 or total < 1 or not 0 <= min_ratio <= 1:
            raise ValueError(
                f"need warmup >= 0, total >= 1 and min_ratio in [0, 1]; got {warmup}, {total}, {min_ratio}"
            )
        self.warmup, self.total, self.min_ratio = int(warmup), int(total), float(min_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        span = max(self.total - self.warmup, 1)
        progress = min((step - self.warmup) / span, 1.0)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Constant:
    def __call__(self, step: int) -> float:
        return 1.0
