"""One outer strategy driven from a framework's hooks: join the islands, attach, save and load its state, finish.

The framework calls `begin` once its model and optimizer exist (a callback's train-begin), `save(folder)` when it
writes a checkpoint, and `end` when training ends; in between the strategy runs from the optimizer's own step hooks
(islands.sync.attach), so every optimizer step the framework takes is an inner step, whatever it does around it
(gradient accumulation, clipping, mixed precision, its LR schedule). After `end` the live model holds the global
model, so what the framework saves at the end is the islands' model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from islands.runtime.world import JoinedWorld, World, close_world, init_world
from islands.sync.attach import Attached
from islands.sync.base import Strategy
from islands.sync.ddp import unwrap

STATE_FILE = "islands-outer-{rank}.pt"  # one per worker of the island (a sharded inner strategy's states differ)


class MissingOuterState(FileNotFoundError):
    """A resumed checkpoint holds no outer state for this worker."""


class OuterRun:
    """The outer `strategy` (islands.outer.DiLoCo(...), any of islands.outer) over this process's islands."""

    def __init__(self, strategy: Strategy, world: World | None = None):
        """`world`: the islands to run across (default: islands.init_world() at `join`, which in a job launched as
        islands of their own, ISLANDS_CROSS_*, joins them; docs/frameworks.md)."""
        self.strategy, self.world = strategy, world
        self.attached: Attached | None = None
        self.began = False  # the strategy is wrapped: its state is worth saving (during training and after)

    def join(self) -> World:
        """The World, made on first use: after the framework made its process group, never before."""
        if self.world is None:
            world = init_world()
            if world.islands > 1 and not isinstance(world, JoinedWorld):
                raise ValueError(
                    f"this job's {world.size} workers form {world.islands} islands in one default process group, "
                    "over which the framework runs DDP: every step would cross between islands. Start each island "
                    "as its own job: `islands run --workers N --islands K --separate-jobs script.py`, or a torchrun "
                    "per island with ISLANDS_CROSS_* set (docs/frameworks.md)"
                )
            self.world = world
        return self.world

    @property
    def island(self) -> int:
        return self.join().island

    def begin(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        step: int = 0,
        resume: Path | str | dict | None = None,
    ) -> int:
        """Wrap `model` (the framework's, wrapped in its DDP or not) and attach to `optimizer` (the torch optimizer
        whose step is one inner step); returns the step the framework goes on from. `step`: the framework's step
        count (its checkpoint's, when it resumed one); `resume`: the outer state saved with that checkpoint, as the
        checkpoint folder `save` wrote into or as the `state()` dict, loaded after every island agreed on the start.

        A restarted island (its job died and came back while the others trained on) enters the members' run in
        the wrap: it receives their global model, outer state and step, which are newer than its own checkpoint's,
        so `resume` is not loaded then and the step returned is the members' (the framework must move its step
        counter and LR schedule there)."""
        world = self.join()
        self.attached = Attached(self.strategy, model, optimizer, world, start=step)
        self.attached.__enter__()
        self.began = True
        if self.entered or resume is None:
            return self.attached.step
        if isinstance(resume, dict):
            self.strategy.load_state_dict(resume)
            return self.attached.step
        path = Path(resume) / STATE_FILE.format(rank=world.local_rank)
        if not path.is_file():
            raise MissingOuterState(
                f"{path} is missing: the checkpoint {resume} was written without islands' callback (or by "
                f"another number of workers per island); resume from one written under the callback"
            )
        self.strategy.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
        return self.attached.step

    @property
    def entered(self) -> bool:
        """Whether this worker entered a run already going on (a restarted island admitted at the members' round
        boundary), holding their state rather than its own checkpoint's."""
        membership = self.join().membership
        return membership is not None and any(e["type"] == "entered" for e in membership.events)

    def save(self, folder: Path | str) -> Path:
        """Write this worker's outer state into the framework's checkpoint `folder`; returns the file."""
        path = Path(folder) / STATE_FILE.format(rank=self.join().local_rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(self.strategy.state_dict(), path)
        return path

    def state(self) -> dict:
        """The outer state (for a framework that keeps it inside its own checkpoint file)."""
        return self.strategy.state_dict()

    @torch.no_grad()
    def end(self, model: torch.nn.Module) -> None:
        """The final synchronisation, then the global model into the live `model` (what the framework saves)."""
        if self.attached is None:
            return
        attached, self.attached = self.attached, None
        attached.__exit__(None, None, None)
        live, glob = unwrap(model), self.strategy.eval_model(model)
        if glob is not live:
            for p, g in zip(live.parameters(), glob.parameters()):
                p.copy_(g)
            for b, h in zip(live.buffers(), glob.buffers()):
                b.copy_(h)

    @property
    def cross_bytes(self) -> int:
        """Bytes this worker sent across islands so far (the World's ledger: its island's own traffic is not in
        it under a joined job)."""
        return self.join().ledger.total_sent

    def close(self) -> None:
        """Leave the islands (islands.close_world)."""
        if self.world is not None:
            close_world(self.world)
