"""A Task: what to learn, as objects. The built-in `lm` and `digits` tasks are two of them (islands.tasks);
a user's `make_task(config)` returns one for `islands train --task my.module:make_task`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Task:
    """`model`: any nn.Module. `loss_fn(prediction, targets) -> scalar`, or None when the model's output carries
    its loss. `train_data`: a Dataset, DataLoader, iterable of batches, or a function (shard, shards) -> batches
    (islands.data.source). `val_data`: batches evaluated on every rank, or None. `metrics`: name ->
    fn(prediction, targets) -> float, averaged over validation samples. `batch_size`: samples per batch on each
    worker when train_data is a Dataset (the CLI fills it from global_batch / workers). `tokens_per_sample`:
    what tokens/s counts per sample (a sequence's length for a language model). `classes`: output classes,
    for a label-flip attack rehearsal. `name` and `data_source` label the run record. `precision`: the step's
    precision when the job leaves it to the task (memory.precision = "task", the default): fp32, bf16 or auto
    (bf16 autocast on CUDA, fp32 on the CPU; islands.memory.resolve_precision)."""

    model: torch.nn.Module
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    train_data: Any
    val_data: Any = None
    metrics: dict[str, Callable] = field(default_factory=dict)
    batch_size: int | None = None
    tokens_per_sample: int = 1
    classes: int | None = None
    name: str = "task"
    data_source: str = ""
    precision: str = "fp32"

    def __post_init__(self):
        if not isinstance(self.model, torch.nn.Module):
            raise TypeError(f"Task.model must be a torch.nn.Module; got {type(self.model).__name__}")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise TypeError(
                f"Task.loss_fn must be callable (prediction, targets) -> scalar, or None; "
                f"got {type(self.loss_fn).__name__}"
            )
        if self.train_data is None:
            raise ValueError(
                "Task.train_data is required: a Dataset, DataLoader, iterable of batches or "
                "a function (shard, shards) -> batches"
            )
