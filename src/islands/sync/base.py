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
global model; nothing needs the total step count up front). `state_dict()` / `load_state_dict()` are for
checkpoints. `eval_model(model)` returns the model to evaluate and export, parameters and buffers (for
local-update strategies, the last synchronised global model).

Inner strategies (single, ddp, zero1, fsdp) act every step inside an island; outer strategies (local
SGD, DiLoCo, gossip) act rarely across islands. `Stack` (sync/stack.py) composes one of each.
Optional capabilities are written protocols, each one method, found by isinstance (never by looking a name
up): `OwnsStep` (`forward_backward`: a pipeline's step is not forward-then-backward, and the loop calls it
instead of its own), `KeepsIslandsApart` (fsdp: a Stack with an outer part asks it to shard inside each
island only), `CompilesByUnit` (`compile_units`, fsdp: the modules the Trainer's compile compiles one by one),
`Describes` (`describe`: what a rank holds, for the run record), `Reports` (`run_report`: sections of
the run record it measured, after finish: a parameter server's servers) and `SkipsSteps` (`next_step`; NoOp's
default skips nothing, DiLoCo's adapt=... rounds skip to the round's end). A strategy made of others
(`Composite`: Stack) names the part that provides a capability (`capability(strategy, OwnsStep)`). In an
elastic world the outer strategy hands `world.membership` itself as the round-counting participant
(islands.runtime.contracts.ElasticParticipant: rounds, settle, joined) from its wrap.
"""

from __future__ import annotations

from typing import Protocol, TypeVar, runtime_checkable

import torch

from islands.runtime.compiled import uncompiled
from islands.runtime.world import NO_OUTER, World
from islands.sync.attach import Attached


@runtime_checkable
class Strategy(Protocol):
    @property
    def name(self) -> str: ...  # read-only here: a Stack derives its name from its parts

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World) -> torch.nn.Module: ...

    def on_batch(self, batch, step: int): ...

    def after_backward(self, model: torch.nn.Module, step: int) -> None: ...

    def after_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None: ...

    def finish(self, model: torch.nn.Module) -> None: ...

    def eval_model(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class OwnsStep(Protocol):
    """A strategy whose step is not forward-then-backward (a pipeline): the loop calls this instead."""

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float: ...


@runtime_checkable
class KeepsIslandsApart(Protocol):
    """An inner strategy that would otherwise span islands (fsdp): under an outer strategy it keeps inside each."""

    def keep_islands_apart(self) -> None: ...


@runtime_checkable
class CompilesByUnit(Protocol):
    """An inner strategy that splits the model into units whose calls a whole-model torch.compile cannot trace through
    (fsdp: the modules fully_shard wrapped, whose hooks torch will not trace): islands' Compile compiles each unit in
    place instead (islands.runtime.compiled.Compile.apply). [] until wrap sharded the model, or when it did not."""

    def compile_units(self) -> list[torch.nn.Module]: ...


@runtime_checkable
class Describes(Protocol):
    """A strategy with something of its own for the run record (a pipeline: every stage's measured activations)."""

    def describe(self) -> dict: ...


@runtime_checkable
class SkipsSteps(Protocol):
    """A strategy whose rounds may skip counted steps: the loop continues from `next_step(done)`."""

    def next_step(self, done: int) -> int: ...


@runtime_checkable
class Reports(Protocol):
    """A strategy with measured numbers of its own for the run record, asked after `finish` on every rank: sections
    of run.json by name ({} where this rank has none; ps: its servers' report, "parameter_server")."""

    def run_report(self) -> dict: ...


@runtime_checkable
class WritesReport(Protocol):
    """A strategy that writes a report of its own at the end (DiLoCo adapt=...: outer_exchanges.json); the app
    sets where (None: not on this worker)."""

    report_dir: str | None


C = TypeVar("C")


@runtime_checkable
class Composite(Protocol):
    """A strategy made of others (Stack): which of its parts provides a capability it does not itself."""

    def part_with(self, kind: type[C]) -> C | None: ...


def capability(strategy, kind: type[C]) -> C | None:
    """`strategy` as a `kind` (one of the capability protocols above), or the part of it that is one; else None."""
    if isinstance(strategy, kind):
        return strategy
    if isinstance(strategy, Composite):
        return strategy.part_with(kind)
    return None


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
        return uncompiled(model)  # a compiled model's plain module: its state_dict keys are the eager ones

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
    membership = world.membership
    if membership is not None and membership.claim(strategy):
        raise ValueError(NO_OUTER)
