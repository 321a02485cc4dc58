"""The Strategy contract: hooks the one training loop calls at fixed points.

A strategy never owns the loop. The loop calls, in order, every step:
    model = strategy.wrap(model, optimizer, world)      once, before training
    loss.backward()
    strategy.after_backward(model, step)                gradients exist, optimizer not yet stepped
    optimizer.step()
    strategy.after_step(model, optimizer, step)         parameters updated locally
and `state_dict()` / `load_state_dict()` for checkpoints. `eval_model(model)` returns the model whose
validation loss is reported (for local-update strategies, the last synchronised global model).
Inner strategies (single, ddp, sharded) act every step inside an island; outer strategies (local SGD,
DiLoCo, gossip) act rarely across islands. `Stack` composes an inner and an outer strategy.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from islands.runtime.world import World


@runtime_checkable
class Strategy(Protocol):
    name: str

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World) -> torch.nn.Module: ...

    def after_backward(self, model: torch.nn.Module, step: int) -> None: ...

    def after_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None: ...

    def eval_model(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class NoOp:
    """Base with do-nothing hooks; concrete strategies override what they need."""

    name = "noop"

    def wrap(self, model, optimizer, world):
        return model

    def after_backward(self, model, step):
        pass

    def after_step(self, model, optimizer, step):
        pass

    def eval_model(self, model):
        return model

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Stack(NoOp):
    """Inner strategy then outer strategy, called in that order at each hook."""

    def __init__(self, inner: Strategy, outer: Strategy | None):
        self.inner, self.outer = inner, outer
        self.name = inner.name if outer is None else f"{inner.name}+{outer.name}"

    def _parts(self):
        return [s for s in (self.inner, self.outer) if s is not None]

    def wrap(self, model, optimizer, world):
        for s in self._parts():
            model = s.wrap(model, optimizer, world)
        return model

    def after_backward(self, model, step):
        for s in self._parts():
            s.after_backward(model, step)

    def after_step(self, model, optimizer, step):
        for s in self._parts():
            s.after_step(model, optimizer, step)

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
