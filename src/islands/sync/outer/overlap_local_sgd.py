"""Overlap local SGD (SOTA-222, LIT-323): the average is in flight while the next tau local steps run.

Every tau steps each island (1) takes the average it started tau steps ago as the new anchor (the
global model), (2) pulls its parameters toward the anchor, x <- x - pull * (x - anchor), and (3)
starts averaging the pulled parameters in the background. The exchange therefore hides behind tau
steps of compute, and the pull keeps islands from drifting apart meanwhile. tau = 0 means no
overlap: a blocking average every step that every island adopts (synchronous parameter averaging),
the reference the communication-to-computation ratio is measured against. With a compressor, each
island sends its pulled parameters minus the anchor they were pulled toward (error feedback per
island), and the average lands as anchor + mean(x - anchor).
"""

from __future__ import annotations

import torch

from islands.aggregate.base import Aggregator
from islands.compress.base import Compressor
from islands.sync.outer.base import OuterStrategy
from islands.sync.outer.exchange import Exchange, Pending


class OverlapLocalSGD(OuterStrategy):
    name = "overlap-local-sgd"

    def __init__(
        self,
        tau: int = 2,
        pull: float = 0.5,
        aggregator: Aggregator | None = None,
        compressor: Compressor | None = None,
    ):
        """`tau`: local steps per round, run while the previous average is in flight (0 = blocking, every step).
        `pull`: strength of the pull toward the anchor after each round, in (0, 1]. `aggregator`: robust.
        `compressor`: compresses each island's parameters minus the anchor (error feedback per island)."""
        super().__init__()
        if tau < 0 or not 0 < pull <= 1:
            raise ValueError(f"need tau >= 0 and pull in (0, 1]; got tau={tau}, pull={pull}")
        self.tau, self.pull = int(tau), float(pull)
        self.exchange = Exchange("outer_params", aggregator=aggregator, compressor=compressor)
        self.pending: Pending | None = None

    def after_step(self, model, optimizer, step):
        self.tick(step)
        if (step + 1) % max(self.tau, 1) == 0:
            self._round()
            if self.tau == 0:
                self.synced()

    def has_pending(self) -> bool:
        return self.pending is not None

    def in_order(self, fn):
        return self.exchange.run(fn)  # behind the average in flight, on the exchange's own thread

    def final_sync(self) -> None:
        self._finish()

    def _round(self) -> None:
        if self.tau == 0:
            self.global_flat = self.exchange.mean(self.comm, self.local.read(), base=self.global_flat)
            self.publish()
            self.adopt_global()
        else:
            if self.pending is not None:
                self.global_flat = self.pending.wait()
                self.publish()
            x = self.local.read()
            x.sub_(x - self.global_flat, alpha=self.pull)
            self.local.write(x)
            self.pending = self.exchange.start(self.comm, x, base=self.global_flat)
        self.rounds += 1

    def _finish(self) -> None:
        # Land what is in flight, then one blocking average so the final global model has everything.
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        self.global_flat = self.exchange.mean(self.comm, self.local.read(), base=self.global_flat)
        self.publish()
        self.adopt_global()
        self.rounds += 1

    def extra_state(self) -> dict:
        # An exchange in flight is already started on every rank: wait for it and keep its result.
        inflight = self.pending.wait().clone() if self.pending is not None else None
        return {"inflight": inflight, "exchange": self.exchange.state_dict()}

    def load_extra_state(self, state: dict) -> None:
        inflight = state.get("inflight")
        self.pending = Pending(value=inflight.to(torch.float32).clone()) if inflight is not None else None
        self.exchange.load_state_dict(state.get("exchange", {}))
