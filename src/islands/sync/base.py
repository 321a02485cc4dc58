"""The Strategy contract: hooks the one training loop calls at fixed points.

A strategy never owns the loop. The loop calls, in order, every step:
    model = strategy.wrap(model, optimizer, world)      once, before training
    batch = strategy.on_batch(batch, step)              the batch about to go forward (usually unchanged)
    loss.backward()
    strategy.after_backward(model, step)                gradients exist, optimizer not yet stepped
    optimizer.step()
    strategy.after_step(model, optimizer, step)         parameters updated locally
then the loop's step count becomes `strategy.next_step(step + 1)` where a strategy has it (one whose
rounds let a slower island skip counted steps), and, once after the last step, `strategy.finish(model)`:
the final synchronisation (a local-update strategy folds every island's unsynchronised work into the
global model; nothing needs the total step count up front). `state_dict()` / `load_state_dict()` are for checkpoints. `eval_model(model)` returns
the model to evaluate and export, parameters and buffers (for local-update strategies, the last
synchronised global model).

Inner strategies (single, ddp, zero1, fsdp) act every step inside an island; outer strategies (local
SGD, DiLoCo, gossip) act rarely across islands. `Stack` (sync/stack.py) composes one of each.
A strategy whose step is not forward-then-backward (a pipeline) also has `forward_backward`, which
the loop then calls instead of its own.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from islands.runtime.world import NO_OUTER, World
from islands.sync.attach import Attached


@runtime_checkable
class Strategy(Protocol):
    name: str

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World) -> torch.nn.Module: ...

    def on_batch(self, batch, step: int): ...

    def after_backward(self, model: torch.nn.Module, step: int) -> None: ...

    def after_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None: ...

    def finish(self, model: torch.nn.Module) -> None: ...

    def eval_model(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class NoOp:
    """Base with do-nothing hooks; concrete strategies override what they need."""

    name = "noop"

    def wrap(self, model, optimizer, world):
        return model

    def on_batch(self, batch, step):
        return batch

    def after_backward(self, model, step):
        pass

    def after_step(self, model, optimizer, step):
        pass

    def finish(self, model):
        pass

    def next_step(self, done: int) -> int:
        """The step count the loop continues from after `done` steps: `done`, unless the strategy's rounds skip
        counted steps (DiLoCo adapt=speed|deadline: a slower island jumps to the round's end after its exchange)."""
        return done

    def eval_model(self, model):
        return model

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def attach(self, model, optimizer, world) -> Attached:
        """Zero-touch use around an unchanged loop: `with strategy.attach(model, opt, world) as model:`.

        The hooks run from the optimizer's own step hooks; leaving the block runs `finish`
        (islands.sync.attach). The block yields the wrapped model: the same object for outer strategies."""
        return Attached(self, model, optimizer, world)


def refuse_alone_in_elastic(strategy, world) -> None:
    """An inner strategy wrapped first in an elastic world holds the membership and has no outer strategy to
    meet the others through: say so instead of letting every worker train alone."""
    membership = getattr(world, "membership", None)
    if membership is not None and membership.claim(strategy):
        raise ValueError(NO_OUTER)
