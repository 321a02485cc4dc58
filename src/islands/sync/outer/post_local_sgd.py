"""Post-local SGD (SOTA-216, LIT-362): average every step until the switch, then local SGD with H.

The switch defaults to the step where the learning-rate schedule first decays: our schedule warms
up linearly and starts its cosine decay at cfg.warmup, so build_outer passes switch = cfg.warmup.
"""

from __future__ import annotations

from islands.sync.outer.local_sgd import LocalSGD


class PostLocalSGD(LocalSGD):
    name = "post-local-sgd"

    def __init__(self, total_steps: int, switch: int, every: int = 16, aggregate: str = "mean"):
        super().__init__(total_steps, every=every, aggregate=aggregate)
        if switch < 0:
            raise ValueError(f"switch must be a step >= 0, got {switch}")
        self.switch = int(switch)

    def due(self, step: int) -> bool:
        done = step + 1
        if done <= self.switch:
            return True  # phase 1: minibatch SGD, one average per step
        return (done - self.switch) % self.every == 0 or self.is_last(step)
