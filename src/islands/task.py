"""A task bundles what to learn: the model, this worker's loader, fixed validation batches and the loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from islands.config import TrainConfig
from islands.data import ArrayLoader, WindowLoader, load_digits, load_text
from islands.data.loader import fixed_val_batches_array, fixed_val_batches_lm
from islands.models import MLP, ByteTransformer, sequence_loss


@dataclass
class Task:
    model: torch.nn.Module
    loader: WindowLoader | ArrayLoader
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    tokens_per_sample: int  # bytes per sequence for lm, 1 per image for digits
    classes: int  # output classes (targets of a label-flip attack)
    data_source: str


def build_task(cfg: TrainConfig, shard: int, shards: int) -> Task:
    """Build the model with the job seed (identical on every rank) and this rank's data shard."""
    torch.manual_seed(cfg.seed)
    if cfg.task == "lm":
        corpus = load_text(cfg.data)
        model = ByteTransformer(cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.context)
        loader = WindowLoader(corpus.train, cfg.context, cfg.batch_per_worker, shard, shards, cfg.seed)
        val = fixed_val_batches_lm(corpus.val, cfg.context, cfg.batch_per_worker, cfg.eval_batches)
        return Task(model, loader, val, sequence_loss, cfg.context, 256, f"{corpus.source} ({corpus.files} files)")
    digits = load_digits()
    model = MLP(64, cfg.hidden, 10)
    loader = ArrayLoader(digits.x_train, digits.y_train, cfg.batch_per_worker, shard, shards, cfg.seed)
    val = fixed_val_batches_array(digits.x_val, digits.y_val, 128)
    return Task(model, loader, val, F.cross_entropy, 1, 10, "sklearn digits")


@torch.no_grad()
def evaluate(model: torch.nn.Module, task: Task, device: torch.device) -> dict:
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for x, y in task.val_batches:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss_sum += task.loss_fn(logits, y).item() * y.numel()
        correct += (logits.argmax(-1) == y).sum().item()
        count += y.numel()
    model.train(was_training)
    return {"val_loss": loss_sum / count, "val_accuracy": correct / count}
