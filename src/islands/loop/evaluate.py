"""Validation of any model on any batches: mean loss, accuracy where it is defined, and the user's metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from islands.data.batches import BatchError, compute_loss, inputs_and_target, prediction, size, to_device


def _weight(target: Any, batch: Any) -> int:
    """How much a batch's mean counts: its target elements (tokens of a sequence batch), else its samples."""
    return int(target.numel()) if torch.is_tensor(target) else size(batch)


def _correct(pred: torch.Tensor, target: Any) -> int | None:
    """Correct argmax predictions, when the targets are class indices shaped like the prediction minus its last dim."""
    if not torch.is_tensor(target) or target.is_floating_point() or pred.shape[:-1] != target.shape:
        return None
    return int((pred.argmax(-1) == target).sum())


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: Iterable,
    loss_fn: Callable | None,
    device: torch.device,
    metrics: dict[str, Callable] | None = None,
    max_batches: int | None = None,
) -> dict:
    """{"val_loss", "val_accuracy" (None where targets are not class indices), **metrics} over `batches`."""
    was_training = model.training
    model.eval()
    loss_sum, weight, correct, counted = 0.0, 0, 0, 0
    sums = {k: 0.0 for k in (metrics or {})}
    samples = 0
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            batch = to_device(batch, device)
            loss, output = compute_loss(model, batch, loss_fn, explain=i == 0)
            _, target = inputs_and_target(batch)
            w = _weight(target, batch)
            loss_sum += loss.item() * w
            weight += w
            try:
                pred = prediction(output)
            except BatchError:  # a model that returns only its loss: no accuracy, no metrics
                pred = None
            hit = _correct(pred, target) if pred is not None else None
            if hit is not None:
                correct += hit
                counted += int(target.numel())
            n = size(batch)
            for name, fn in (metrics or {}).items():
                sums[name] += float(fn(pred, target)) * n
            samples += n
    finally:
        model.train(was_training)
    if weight == 0:
        raise ValueError("validation data yielded no batches")
    out = {"val_loss": loss_sum / weight, "val_accuracy": correct / counted if counted else None}
    out.update({name: total / max(samples, 1) for name, total in sums.items()})
    return out
