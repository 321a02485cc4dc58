"""`Stack(inner, outer)`: an inner strategy (inside an island) and an optional outer one (across islands).

Each hook runs the inner strategy first, then the outer one; `eval_model` unwraps in reverse order.
The inner default is DDP, which over an island of one worker is the plain model, so `Stack(outer=...)`
is right for any island size.

In an elastic world (islands.runtime.elastic) the Stack holds the membership: its wrap claims it before
the parts wrap and ends with `enter` (a joiner blocks there until admitted, then holds the members' global
model, strategy state and step, world.start_step); its after_backward calls `at_step` first, where the
members admit joiners after a round boundary. An elastic Stack needs an outer part.
"""

from __future__ import annotations

from islands.runtime.world import NO_OUTER
from islands.sync.base import KeepsIslandsApart, NoOp, SkipsSteps, Strategy, capability
from islands.sync.ddp import DDP


class Stack(NoOp):
    def __init__(self, inner: Strategy | None = None, outer: Strategy | None = None):
        self.inner = DDP() if inner is None else inner
        self.outer = outer
        self.membership = None  # the elastic membership, when this Stack holds it (wrap)
        for label, part in (("inner", self.inner), ("outer", outer)):
            if part is not None and not isinstance(part, Strategy):
                raise TypeError(
                    f"Stack({label}=...) takes a strategy (islands.inner.DDP(), islands.outer.DiLoCo(...)); "
                    f"got {type(part).__name__}"
                )
        apart = capability(self.inner, KeepsIslandsApart)  # type: ignore[type-abstract]  # mypy#4717 (Protocol as type[C])
        if outer is not None and apart is not None:  # fsdp: shard inside each island, the outer part joins them
            apart.keep_islands_apart()

    @property
    def name(self) -> str:
        """Read when asked: an inner strategy names itself in wrap (DDP under a 1-bit optimizer: synced-by-...)."""
        return self.inner.name if self.outer is None else f"{self.inner.name}+{self.outer.name}"

    @name.setter
    def name(self, value: str) -> None:  # NoOp's name is writeable; a Stack's is not (as before: AttributeError)
        raise AttributeError(f"a Stack's name comes from its parts; cannot set it to {value!r}")

    def _parts(self):
        return [s for s in (self.inner, self.outer) if s is not None]

    def part_with(self, kind):
        """The part that provides a capability the Stack does not (base.Composite): the inner strategy's own step
        body (a pipeline owns forward and backward) and record (describe), or its outer part's."""
        for part in self._parts():
            found = capability(part, kind)
            if found is not None:
                return found
        return None

    def wrap(self, model, optimizer, world):
        membership = world.membership
        held = membership is not None and membership.claim(self)  # before the parts: the Stack holds it
        if held and self.outer is None:
            raise ValueError(NO_OUTER)
        for s in self._parts():
            model = s.wrap(model, optimizer, world)
        if held:
            self.membership = membership
            world.start_step = membership.enter(self, model)
        return model

    def on_batch(self, batch, step):
        for s in self._parts():
            batch = s.on_batch(batch, step)
        return batch

    def after_backward(self, model, step):
        if self.membership is not None:  # elastic: joiners enter after a round boundary
            self.membership.at_step(self, model, step)
        for s in self._parts():
            s.after_backward(model, step)

    def after_step(self, model, optimizer, step):
        for s in self._parts():
            s.after_step(model, optimizer, step)

    def finish(self, model):
        for s in self._parts():
            s.finish(model)

    def next_step(self, done: int) -> int:
        # the outer strategy's rounds decide (DiLoCo adapt=...); the ignore: mypy#4717 (a Protocol as type[C])
        skip = capability(self.outer, SkipsSteps)  # type: ignore[type-abstract]
        return skip.next_step(done) if skip is not None else done

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
