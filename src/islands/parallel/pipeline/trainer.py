"""The training loop for inner=pipeline: the trainer's loop with a step that runs a pipeline schedule.

The Strategy hooks see a finished backward; a pipeline has to own forward and backward over its
micro-batches, so this subclass replaces only `train_step` (and adds the pipeline to the run record).
Every stage reads the same batches: the island's shard, pulled once per stage so a step consumes the
job's global batch (cfg.batch_per_worker samples per pull, workers-per-island pulls).
"""

from __future__ import annotations

import time

import torch

from islands.measure.record import write_json_atomic
from islands.trainer import Trainer, lr_at


class PipelineTrainer(Trainer):
    def __init__(self, cfg, world, run_dir=None):
        if world.data_shard is None:  # all stages of an island read one stream
            world.data_shard = (world.island, world.islands) if world.distributed else (0, 1)
        super().__init__(cfg, world, run_dir)
        self.pipeline = self.strategy.inner

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        pulls = [self.task.loader.next() for _ in range(self.pipeline.count)]
        return torch.cat([x for x, _ in pulls]), torch.cat([y for _, y in pulls])

    def train_step(self) -> float:
        cfg, step = self.cfg, self.step
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = self._batch()
        loss = self.pipeline.forward_backward(x.to(self.world.device), y.to(self.world.device))
        self.strategy.after_backward(self.model, step)  # clips by the norm over all stages
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t = time.perf_counter()
        self.strategy.after_step(self.model, self.optimizer, step)
        self.sync_seconds += time.perf_counter() - t
        self.step += 1
        return loss

    def _finish(self, *args, **kwargs) -> dict:
        mine = self.pipeline.describe()
        stages = self.world.all_gather_object(mine) if self.world.distributed else [mine]  # bookkeeping
        record = super()._finish(*args, **kwargs)
        record["pipeline"] = {"stages": stages, "definition": "held_activation_bytes_peak: storages autograd "
                              "saved plus the stage's input and output, for micro-batches in flight at once"}
        if self.world.rank == 0 and self.run_dir is not None:
            write_json_atomic(self.run_dir / "run.json", record)
        return record
