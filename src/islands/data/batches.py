"""What the loop needs to know about a user's batches and model outputs, and nothing more.

A batch is whatever the data yields; its shape decides how the model is called and what the loss sees:

    (inputs, targets)           output = model(inputs);            loss = loss_fn(prediction, targets)
    (a, b, ..., targets)        output = model(a, b, ...);         loss = loss_fn(prediction, targets)
    {"input_ids": .., ...}      output = model(**batch);           loss = loss_fn(prediction, batch) or output.loss
    a tensor                    output = model(batch);             loss = loss_fn(prediction, batch)

`prediction` is the model output reduced to one tensor: a tensor as it is, a `transformers` ModelOutput
(or any mapping) through its `logits`, a tuple or list through its first element. With `loss_fn=None`
the output must carry its own loss (`output.loss`, as a `transformers` model given `labels` does).
The leading dimension of every tensor in a batch is the sample dimension: micro-batching splits it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


class BatchError(ValueError):
    """A batch, model output or loss the loop cannot use; the message says what it got and what works."""


def describe(batch: Any) -> str:
    """`tuple(Tensor[16, 128] int64, Tensor[16] int64)`: a batch's structure, for error messages."""
    if torch.is_tensor(batch):
        return f"Tensor[{', '.join(map(str, batch.shape))}] {str(batch.dtype).removeprefix('torch.')}"
    if isinstance(batch, Mapping):
        return "dict(" + ", ".join(f"{k}={describe(v)}" for k, v in batch.items()) + ")"
    if isinstance(batch, (tuple, list)):
        return f"{type(batch).__name__}(" + ", ".join(describe(v) for v in batch) + ")"
    return type(batch).__name__


def to_device(batch: Any, device: torch.device) -> Any:
    if torch.is_tensor(batch):
        return batch.to(device)
    if isinstance(batch, Mapping):  # a plain dict: model(**batch) is all the loop does with it
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(to_device(v, device) for v in batch)
    if isinstance(batch, list):
        return [to_device(v, device) for v in batch]
    return batch


def size(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor."""
    if torch.is_tensor(batch):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    for v in values:
        if torch.is_tensor(v) or isinstance(v, (Mapping, tuple, list)):
            n = size(v)
            if n:
                return n
    return 0


def split(batch: Any, sizes: list[int]) -> list[Any]:
    """The batch cut along its sample dimension into pieces of `sizes` samples."""
    if torch.is_tensor(batch):
        return list(batch.split(sizes)) if batch.dim() else [batch] * len(sizes)
    if isinstance(batch, Mapping):
        parts = {k: split(v, sizes) for k, v in batch.items()}
        return [{k: parts[k][i] for k in parts} for i in range(len(sizes))]
    if isinstance(batch, (tuple, list)):
        columns = [split(v, sizes) for v in batch]
        return [type(batch)(p[i] for p in columns) for i in range(len(sizes))]
    return [batch] * len(sizes)


def inputs_and_target(batch: Any) -> tuple[Callable[[torch.nn.Module], Any], Any]:
    """(call the model on the batch, what the loss compares against)."""
    if isinstance(batch, Mapping):
        return (lambda model: model(**batch)), batch
    if isinstance(batch, (tuple, list)):
        if len(batch) < 2:
            raise BatchError(f"a tuple batch must be (inputs..., targets); got {describe(batch)}")
        *inputs, target = batch
        return (lambda model: model(*inputs)), target
    if torch.is_tensor(batch):
        return (lambda model: model(batch)), batch
    raise BatchError(
        f"a batch must be a tensor, a tuple (inputs..., targets) or a dict of model keyword "
        f"arguments; got {describe(batch)}"
    )


def prediction(output: Any) -> torch.Tensor:
    """The output as one tensor: itself, its `logits`, or its first element."""
    if torch.is_tensor(output):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if torch.is_tensor(logits):
        return logits
    if isinstance(output, (tuple, list)) and output and torch.is_tensor(output[0]):
        return output[0]
    raise BatchError(
        f"cannot read a prediction from the model's output {describe(output)}: return a tensor, a "
        "tuple whose first element is the prediction, or an object with `logits`"
    )


def own_loss(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if not torch.is_tensor(loss):
        raise BatchError(
            f"loss_fn=None needs a model output that carries its loss (`output.loss`, as a transformers "
            f"model given labels= does); this model returned {describe(output)}. Pass loss_fn=..."
        )
    return loss


def compute_loss(
    model: torch.nn.Module, batch: Any, loss_fn: Callable | None, explain: bool = False
) -> tuple[torch.Tensor, Any]:
    """(scalar loss, raw output) of one forward on the batch. `explain` (the loop's first step): a model that
    cannot take the batch, or a loss that cannot take the prediction, raises BatchError naming the structures,
    with the original error."""
    call, target = inputs_and_target(batch)
    try:
        output = call(model)
    except Exception as e:
        if not explain:
            raise
        raise BatchError(
            f"the model ({type(model).__name__}) could not take the batch {describe(batch)}: {type(e).__name__}: {e}"
        ) from e
    if loss_fn is None:
        loss = own_loss(output)
    else:
        pred = prediction(output)
        try:
            loss = loss_fn(pred, target)
        except Exception as e:
            if not explain:
                raise
            raise BatchError(
                f"loss_fn could not take (prediction {describe(pred)}, targets {describe(target)}): "
                f"{type(e).__name__}: {e}"
            ) from e
    if not torch.is_tensor(loss) or loss.dim() != 0:
        got = describe(loss) if torch.is_tensor(loss) else type(loss).__name__
        raise BatchError(f"loss_fn must return a scalar tensor (the mean over the batch); it returned {got}")
    return loss, output


def concat(batches: list[Any]) -> Any:
    """Batches of one structure joined along the sample dimension (the inverse of split)."""
    first = batches[0]
    if torch.is_tensor(first):
        return torch.cat(batches) if first.dim() else first
    if isinstance(first, Mapping):
        return {k: concat([b[k] for b in batches]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(concat([b[i] for b in batches]) for i in range(len(first)))
    return first
