"""Local SGD (LIT-361): every island trains alone and the islands average their parameters every H steps.

One all-reduce of the fp32 parameters per round (ledger kind "outer_params"). With H = 1 it is
synchronous parameter averaging: the reference DiLoCo must reproduce with outer SGD lr 1, momentum 0.
With a compressor, each island sends its change since the last average instead (local - global, a
pseudo-gradient, error feedback per island), and the new average is global + mean(local - global):
the same average, of what a compressor can shrink (ledger kinds "compress_*").
"""

from __future__ import annotations

from islands.aggregate.base import Aggregator
from islands.compress.base import Compressor
from islands.sync.outer.base import OuterStrategy
from islands.sync.outer.exchange import Exchange


class LocalSGD(OuterStrategy):
    name = "local-sgd"

    def __init__(self, every: int = 8, aggregator: Aggregator | None = None, compressor: Compressor | None = None):
        """`every` H: local steps between parameter averages. `aggregator`: a robust aggregator across islands.
        `compressor`: compresses each island's change since the last average (error feedback per island)."""
        super().__init__()
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = int(every)
        self.exchange = Exchange("outer_params", aggregator=aggregator, compressor=compressor)

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0

    def after_step(self, model, optimizer, step):
        self.tick(step)
        if self.due(step):
            self.average()
            self.synced()

    def final_sync(self) -> None:
        self.average()

    def average(self) -> None:
        self.global_flat = self.exchange.mean(self.comm, self.local.read(), base=self.global_flat)
        self.publish()
        self.adopt_global()
        self.rounds += 1

    def extra_state(self) -> dict:
        return {"exchange": self.exchange.state_dict()}

    def load_extra_state(self, state: dict) -> None:
        self.exchange.load_state_dict(state.get("exchange", {}))
