"""What the Trainer's loop (islands.loop.trainer) reads off each step: its loss and its wall time.

The loss stays where the step left it (float64, on the device) and is read on the host only where someone
reads it: a log entry (the mean since the last one) or a callback that asks (`trainer.loss`, read once per
step and cached). On a GPU a float() each step would stall the queue of kernels every step. The sum since
the last entry is float64 on the device, so the series' means equal those of the host floats added in the
same order.
"""

from __future__ import annotations

import numpy as np
import torch


class StepReadout:
    def __init__(self, log_every: int):
        self.log_every = log_every  # steps per entry of the training-loss series
        self.last: torch.Tensor | None = None  # the last step's loss, float64, where the step left it
        self._value: float | None = None  # its host float, once read
        self._sum: torch.Tensor | None = None  # since the last log entry
        self._count = 0
        self.seconds: list[float] = []  # each step's wall time; the median resists other processes' bursts

    def took(self, loss) -> None:
        """The loss a step returned (a tensor anywhere, or a number); nothing is read from the device."""
        self.last = torch.as_tensor(loss).detach().reshape(()).to(torch.float64)
        self._value = None

    def took_float(self, value: float) -> None:
        """The loss as a host float (a Trainer subclass's own train_step returns one)."""
        self._value = float(value)
        self.last = torch.tensor(self._value, dtype=torch.float64)

    @property
    def loss(self) -> float:
        """The last step's loss on the host (read from the device once, on first use); nan before any step."""
        if self._value is None and self.last is not None:
            self._value = float(self.last)
        return self._value if self._value is not None else float("nan")

    def entry(self, step: int, total_steps: int) -> float | None:
        """Add the last step's loss to the sum; at a log entry (every log_every steps and the last step) the
        mean since the previous entry, read on the host (the one wait for the device), else None."""
        last = self.last
        assert last is not None, "entry() follows a step's took()"
        total = self._sum = last if self._sum is None else self._sum + last
        self._count += 1
        if step % self.log_every == 0 or step == total_steps:
            mean = float(total) / self._count
            self._sum, self._count = None, 0
            return mean
        return None

    def timed(self, seconds: float) -> None:
        self.seconds.append(seconds)

    def median_seconds(self) -> float:
        return float(np.median(self.seconds)) if self.seconds else 0.0
