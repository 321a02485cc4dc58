"""A PyTorch Lightning Trainer as one island: an outer strategy across islands from a Lightning Callback.

    from islands.integrations.lightning import IslandsCallback
    trainer = L.Trainer(strategy="ddp", devices=2, callbacks=[IslandsCallback(islands.outer.DiLoCo(inner_steps=50))])
    trainer.fit(module, data)   # Lightning's DDP inside the island; DiLoCo across islands
    trainer.save_checkpoint("final.ckpt")  # the global model

Launch each island as its own job (docs/frameworks.md). Every optimizer step Lightning takes is an inner step.
The outer state rides in Lightning's checkpoints (the callback's `state_dict`, under the callback's key), so
`trainer.fit(..., ckpt_path=...)` continues it; at the end of fit the module holds the global model.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.seed import seed_everything

from islands.integrations.outer_run import OuterRun
from islands.sync.base import Strategy


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
        # the checkpoint (if any) is loaded by now: the module's weights and, through load_state_dict, ours
        self.run.begin(pl_module, trainer.optimizers[0], step=trainer.global_step)
        if self._resumed is not None:
            self.run.load(self._resumed)
            self._resumed = None

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
