"""Local SGD (LIT-361): every island trains alone and the islands average their parameters every H steps.

One all-reduce of the fp32 parameters per round (ledger kind "outer_params"). With H = 1 it is
synchronous parameter averaging: the reference DiLoCo must reproduce with outer SGD lr 1, momentum 0.
"""

from __future__ import annotations

from islands.sync.outer.base import OuterStrategy
from islands.sync.outer.exchange import Exchange


class LocalSGD(OuterStrategy):
    name = "local-sgd"

    def __init__(self, total_steps: int, every: int = 8, aggregate: str = "mean"):
        super().__init__(total_steps)
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = int(every)
        self.exchange = Exchange("outer_params", aggregate=aggregate)

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0 or self.is_last(step)

    def after_step(self, model, optimizer, step):
        if self.due(step):
            self.average()

    def average(self) -> None:
        self.global_flat = self.exchange.mean(self.comm, self.local.read())
        self.publish()
        self.adopt_global()
        self.rounds += 1

    def extra_state(self) -> dict:
        return {"exchange": self.exchange.state_dict()}

    def load_extra_state(self, state: dict) -> None:
        self.exchange.load_state_dict(state.get("exchange", {}))
