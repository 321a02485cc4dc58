"""What every outer strategy shares: the cross-island Comm, the global model, flat views, the clock.

An outer strategy runs across islands, after the inner strategy (ddp inside each island) has
stepped. It keeps:
  self.comm          the ONE object all its cross-island traffic goes through (Comm interface:
                     all_reduce, all_gather, broadcast, size, rank); set in wrap() from
                     world.comm("cross"), and replaceable (e.g. by an elastic Comm) between steps
  self.global_flat   fp32 vector of the last synchronised global parameters
  self.global_model  a copy of the model holding them: what eval_model() returns
  self.local         FlatView over the live (local) parameters the inner optimizer updates
Policy for the end of training: the last step always synchronises (a shortened final round), so
the reported global model contains every island's work.
"""

from __future__ import annotations

import copy

import torch

from islands.sync.base import NoOp
from islands.sync.ddp import unwrap
from islands.sync.outer.flat import FlatView


class LoneComm:
    """The cross-island Comm of a job with one island and no process group: every collective is identity."""

    size, rank = 1, 0

    def all_reduce(self, tensor, op=None, kind: str = "all_reduce"):
        return tensor

    def all_gather(self, tensor, kind: str = "all_gather"):
        return [tensor]

    def broadcast(self, tensor, src: int = 0, kind: str = "broadcast"):
        return tensor


class OuterStrategy(NoOp):
    name = "outer"

    def __init__(self, total_steps: int):
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        self.total_steps = int(total_steps)
        self.comm = None
        self.rounds = 0  # completed synchronisations

    # ---- wiring -----------------------------------------------------------------------------------
    def wrap(self, model, optimizer, world):
        self.comm = world.comm("cross") if world.distributed else LoneComm()
        base = unwrap(model)
        self.optimizer = optimizer
        self.local = FlatView(base.parameters())
        self.global_model = copy.deepcopy(base).requires_grad_(False)
        self.global_view = FlatView(self.global_model.parameters())
        self.global_flat = self.local.read()
        self.setup()
        return model

    def setup(self) -> None:
        """Subclasses build their exchange and state here (self.local and self.global_flat exist)."""

    def eval_model(self, model):
        return self.global_model

    # ---- helpers for subclasses -------------------------------------------------------------------
    def is_last(self, step: int) -> bool:
        return step + 1 >= self.total_steps

    def publish(self, lo: int = 0, hi: int | None = None) -> None:
        """Copy global_flat[lo:hi] into the global model (what evaluation sees)."""
        hi = self.global_flat.numel() if hi is None else hi
        self.global_view.write(self.global_flat[lo:hi], lo)

    def adopt_global(self, lo: int = 0, hi: int | None = None) -> None:
        """Local parameters restart from the global ones (the usual end of a round)."""
        hi = self.global_flat.numel() if hi is None else hi
        self.local.write(self.global_flat[lo:hi], lo)

    # ---- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        # "local" carries this worker's live parameters mid-round: the trainer's "model" entry is
        # the global model (eval_model), so without it a resume would lose the round's local work.
        return {"global": self.global_flat.clone(), "local": self.local.read(), "rounds": self.rounds,
                **self.extra_state()}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        for key in ("global", "local"):
            if state[key].numel() != self.global_flat.numel():
                raise ValueError(f"{self.name}: checkpoint {key!r} has {state[key].numel()} values, "
                                 f"the model has {self.global_flat.numel()}; was it saved for another model?")
        self.global_flat = state["global"].to(torch.float32).clone()
        self.publish()
        self.local.write(state["local"].to(torch.float32))
        self.rounds = int(state.get("rounds", 0))
        self.load_extra_state(state)

    def extra_state(self) -> dict:
        return {}

    def load_extra_state(self, state: dict) -> None:
        pass
