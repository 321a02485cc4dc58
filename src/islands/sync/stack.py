"""`Stack(inner, outer)`: an inner strategy (inside an island) and an optional outer one (across islands).

Each hook runs the inner strategy first, then the outer one; `eval_model` unwraps in reverse order.
The inner default is DDP, which over an island of one worker is the plain model, so `Stack(outer=...)`
is right for any island size.
"""

from __future__ import annotations

from islands.sync.base import NoOp, Strategy
from islands.sync.ddp import DDP


class Stack(NoOp):
    def __init__(self, inner: Strategy | None = None, outer: Strategy | None = None):
        self.inner = DDP() if inner is None else inner
        self.outer = outer
        for label, part in (("inner", self.inner), ("outer", outer)):
            if part is not None and not isinstance(part, Strategy):
                raise TypeError(f"Stack({label}=...) takes a strategy (islands.inner.DDP(), islands.outer.DiLoCo(...)); "
                                f"got {type(part).__name__}")

    @property
    def name(self) -> str:
        """Read when asked: an inner strategy names itself in wrap (DDP under a 1-bit optimizer: synced-by-...)."""
        return self.inner.name if self.outer is None else f"{self.inner.name}+{self.outer.name}"

    def _parts(self):
        return [s for s in (self.inner, self.outer) if s is not None]

    @property
    def forward_backward(self):
        """The inner strategy's own step body, if it has one (a pipeline owns forward and backward)."""
        return getattr(self.inner, "forward_backward", None)

    def wrap(self, model, optimizer, world):
        for s in self._parts():
            model = s.wrap(model, optimizer, world)
        return model

    def on_batch(self, batch, step):
        for s in self._parts():
            batch = s.on_batch(batch, step)
        return batch

    def after_backward(self, model, step):
        for s in self._parts():
            s.after_backward(model, step)

    def after_step(self, model, optimizer, step):
        for s in self._parts():
            s.after_step(model, optimizer, step)

    def finish(self, model):
        for s in self._parts():
            s.finish(model)

    def eval_model(self, model):
        for s in reversed(self._parts()):
            model = s.eval_model(model)
        return model

    def state_dict(self):
        return {"inner": self.inner.state_dict(), "outer": self.outer.state_dict() if self.outer else {}}

    def load_state_dict(self, state):
        self.inner.load_state_dict(state.get("inner", {}))
        if self.outer:
            self.outer.load_state_dict(state.get("outer", {}))
