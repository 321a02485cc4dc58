"""Post-local SGD (SOTA-216, LIT-362): average every step until the switch, then local SGD with H.

SOTA-216 switches where the learning-rate schedule first decays: with the built-in schedule (linear
warm-up, then cosine) that is the end of the warm-up, which the job config passes as `switch`.
"""

from __future__ import annotations

from islands.aggregate.base import Aggregator
from islands.compress.base import Compressor
from islands.sync.outer.local_sgd import LocalSGD


class PostLocalSGD(LocalSGD):
    name = "post-local-sgd"

    def __init__(
        self, switch: int, every: int = 16, aggregator: Aggregator | None = None, compressor: Compressor | None = None
    ):
        """`switch`: the step at which averaging every step ends (SOTA-216: where the lr first decays).
        `every` H after the switch (SOTA-216 suggests 16 to 32). `aggregator`: robust across islands. `compressor`:
        compresses each island's change since the last average, in both phases (local-sgd's)."""
        super().__init__(every=every, aggregator=aggregator, compressor=compressor)
        if switch < 0:
            raise ValueError(f"switch must be a step >= 0, got {switch}")
        self.switch = int(switch)

    def due(self, step: int) -> bool:
        done = step + 1
        if done <= self.switch:
            return True  # phase 1: minibatch SGD, one average per step
        return (done - self.switch) % self.every == 0
