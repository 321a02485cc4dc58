"""A PyTorch Lightning Trainer as one island: an outer strategy across islands from a Lightning Callback.

    from islands.integrations.lightning import IslandsCallback
    trainer = L.Trainer(strategy="ddp", devices=2, callbacks=[IslandsCallback(islands.outer.DiLoCo(inner_steps=50))])
    trainer.fit(module, data)   # Lightning's DDP inside the island; DiLoCo across islands
    trainer.save_checkpoint("final.ckpt")  # the global model

Launch each island as its own job (docs/frameworks.md). Every optimizer step Lightning takes is an inner step.
The outer state rides in Lightning's checkpoints (the callback's `state_dict`, under the callback's key), so
`trainer.fit(..., ckpt_path=...)` continues it; at the end of fit the module holds the global model. A restarted
island (fit from its own last checkpoint, or from scratch) enters at the members' round boundary with their global
model, outer state and step: `trainer.global_step` and the step-interval LR schedules move on to that step.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.seed import seed_everything
from torch.optim.lr_scheduler import LRScheduler

from islands.integrations.outer_run import OuterRun
from islands.sync.base import Strategy


def skip_ahead(trainer: pl.Trainer, step: int) -> None:
    """Move Lightning's step counter (`trainer.global_step`, which `max_steps` and checkpoint names read) and the
    step-interval LR schedules to `step`. Lightning has no public setter: global_step is the optimizer-step
    progress of the fit loop's epoch loop (automatic or manual optimization), so that progress is moved. The data
    order is not skipped: a restarted island draws batches afresh from its own shard."""
    loop = trainer.fit_loop.epoch_loop
    if trainer.lightning_module.automatic_optimization:
        progress = loop.automatic_optimization.optim_progress.optimizer.step.total
    else:
        progress = loop.manual_optimization.optim_step_progress.total
    progress.ready = progress.completed = step
    loop._batches_that_stepped = step  # the step loggers write against
    for config in trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        # a plateau schedule follows a metric, not the step count
        if config.interval == "step" and not config.reduce_on_plateau and isinstance(scheduler, LRScheduler):
            with warnings.catch_warnings():  # torch warns of a schedule stepped before its optimizer: meant here
                warnings.simplefilter("ignore", UserWarning)
                scheduler.last_epoch = step // config.frequency - 1
                scheduler.step()


class IslandsCallback(pl.Callback):
    """Runs `strategy` (any outer strategy of islands.outer) across islands while Lightning trains inside its
    island. In a job of several islands each island seeds everything (seed_everything) with its index added to
    PL_GLOBAL_SEED at `on_fit_start`, so islands draw different data orders (Lightning's DistributedSampler reads it)
    and dropout masks; every island starts from island 0's weights all the same."""

    def __init__(self, strategy: Strategy, run: OuterRun | None = None):
        self.run = run or OuterRun(strategy)
        self._resumed: dict | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        world = self.run.join()  # Lightning's strategy made the island's process group by now
        if world.islands > 1:  # before the fit loop builds its samplers (they read PL_GLOBAL_SEED)
            seed_everything(int(os.environ.get("PL_GLOBAL_SEED", "0")) + world.island, verbose=False)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the checkpoint (if any) is loaded by now: the module's weights, the loops' step and, through
        # load_state_dict, the outer state
        resumed, self._resumed = self._resumed, None
        step = self.run.begin(pl_module, trainer.optimizers[0], step=trainer.global_step, resume=resumed)
        if step > trainer.global_step:  # a restarted island entered at the members' step: go on from there
            skip_ahead(trainer, step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run.end(pl_module)

    def state_dict(self) -> dict[str, Any]:
        return {"outer": self.run.state()} if self.run.began else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed = state_dict.get("outer")

    @property
    def state_key(self) -> str:
        return f"IslandsCallback[{type(self.run.strategy).__name__}]"

    @property
    def cross_bytes(self) -> int:
        """Bytes this worker sent across islands so far."""
        return self.run.cross_bytes
