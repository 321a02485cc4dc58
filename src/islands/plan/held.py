"""Bytes of tensors a run actually holds: every tensor reachable from the given objects (a model, its optimizer, the
strategy), each storage counted once. What memory predictions are checked against on a CPU, where the allocator
keeps no peak (on CUDA, torch.cuda.max_memory_allocated is the measure); with the saved-for-backward peak
(islands.memory.SavedTensorMeter) it is the step's peak of tensor bytes: `held_peak` for a trainer,
`simulated_held_peak` for each island of an outer strategy's job run in one process."""

from __future__ import annotations

import torch

from islands.app.build import build_outer, build_task
from islands.config import JobConfig
from islands.data.batches import to_device
from islands.data.source import batch_source
from islands.loop.trainer import Trainer
from islands.memory.accounting import SavedTensorMeter
from islands.plan.job import job_trainer
from islands.runtime import simulate
from islands.runtime.world import World
from islands.sync.stack import Stack


def held_bytes(*roots, exclude=()) -> int:
    """Sum of the distinct storages of tensors reachable from `roots` through attributes, dicts, lists, tuples and
    sets (modules and optimizers included; a DTensor counts as its local shard); storages of tensors reachable from
    `exclude` are left out."""
    skip = {_key(t) for t in _tensors(exclude)}
    sizes = {}
    for t in _tensors(roots):
        k = _key(t)
        if k not in skip:
            sizes[k] = t.untyped_storage().nbytes()
    return sum(sizes.values())


def _key(t: torch.Tensor) -> tuple:
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


def _tensors(roots):
    # imported here, not at the top: torch.distributed.tensor costs ~0.45 s of CPU, which every `islands` command
    # paid through the CLI's plan command (`islands --help` included), where only a measurement needs it
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, DTensor):  # FSDP's parameters, gradients and optimizer state: what this rank holds
            with torch.no_grad():
                stack.append(obj.to_local())
            if obj.grad is not None:
                stack.append(obj.grad)
            continue
        if isinstance(obj, torch.Tensor):
            if obj.untyped_storage().nbytes():
                yield obj
            if obj.grad is not None:
                stack.append(obj.grad)
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and (
            isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))  # a user's or transformers' module too
            or type(obj).__module__.split(".")[0] in ("islands", "torch", "__main__")
        ):
            stack.extend(vars(obj).values())
        elif hasattr(obj, "__slots__"):
            stack.extend(getattr(obj, s, None) for s in obj.__slots__ if isinstance(s, str))


def held_peak(trainer: Trainer, steps: int, batch) -> int:
    """The trainer's peak of tensor bytes over a short run: after `steps` steps, what its model, optimizer and
    strategy hold, plus the saved-for-backward peak of one more forward and backward on `batch` (whose gradients
    are then counted too). A simulated world's Comms are left out: their mailboxes may still hold the last
    collective's result, a simulation's, not the job's."""
    trainer.fit(steps)
    model = trainer.model
    with SavedTensorMeter(exclude=list(model.parameters())) as meter:
        trainer.step_fn(model, to_device(batch, trainer.world.device), trainer.body.loss_fn)
    comms = trainer.world.comms or {}
    return held_bytes(model, trainer.optimizer, trainer.strategy, exclude=[comms]) + meter.peak


def simulated_held_peak(cfg: JobConfig, steps: int) -> list[int]:
    """held_peak of each island of `cfg`'s job (its outer strategy over cfg.world.islands islands of one worker),
    run in one process (islands.simulate), the job's Trainer built as the planner builds it (plan.job)."""
    assert cfg.outer.strategy, "simulated_held_peak measures an outer strategy's job"

    def main(world: World) -> int:
        task = build_task(cfg)
        trainer = job_trainer(cfg, task, world, Stack(outer=build_outer(cfg, None)))
        batch = batch_source(task.train_data, 0, 1, task.batch_size, cfg.train.seed).next()
        return held_peak(trainer, steps, batch)

    return simulate.run(main, islands=cfg.world.islands)
