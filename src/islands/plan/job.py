"""The job's Trainer as the planner runs it: one worker's step built as `islands train` builds it, on a fresh copy of
the task's model, for the profile (World.single) and for the memory checks (a simulated world)."""

from __future__ import annotations

import copy
import dataclasses

from islands.app.build import build_optimizer_for, build_step_fn
from islands.config import JobConfig
from islands.loop.schedule import WarmupCosine
from islands.loop.task import Task
from islands.loop.trainer import Trainer
from islands.runtime.world import World
from islands.sync.base import Strategy
from islands.sync.single import Single
from islands.sync.stack import Stack


def job_trainer(cfg: JobConfig, task: Task, world: World, strategy: Strategy | None = None) -> Trainer:
    """A Trainer for `cfg`'s job on `world`: its optimizer, lr schedule, clipping, micro-batches and precision
    (islands.app.build) over a fresh copy of `task`'s model; no callbacks, no validation. `strategy`: default
    Stack(Single()) (no other rank)."""
    model = copy.deepcopy(task.model).to(world.device)
    optimizer = build_optimizer_for(cfg, model, world)
    step_fn = build_step_fn(cfg, dataclasses.replace(task, model=model), optimizer, world)
    return Trainer(
        model,
        optimizer,
        task.loss_fn,
        task.train_data,
        None,
        strategy=strategy if strategy is not None else Stack(Single()),
        world=world,
        schedule=WarmupCosine(cfg.train.warmup, cfg.train.steps, cfg.train.min_lr_ratio),
        batch_size=task.batch_size,
        grad_clip=cfg.train.grad_clip,
        step_fn=step_fn,
        seed=cfg.train.seed,
        log_every=cfg.train.log_every,
    )
