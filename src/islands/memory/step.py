"""One step's forward and backward: gradient accumulation over micro-batches, under a chosen precision.

Micro-batches (SOTA-031): the worker's batch is cut into pieces of `micro_batch` samples; each piece's
mean loss is weighted by its share of the batch, so the accumulated gradient is the full batch's mean-loss
gradient (the last piece may be smaller). Under DDP every piece but the last runs inside `no_sync()`, so
gradients are exchanged once per step, whole: bucket hooks (compression, robust aggregation) and outer
strategies see one gradient per step, as without accumulation.

Precision (SOTA-118): "bf16" runs the forward under autocast to bfloat16. Parameters, gradients and
optimizer state stay fp32 (the master copy); matmuls and the activations they save are bf16. The loss is
taken in fp32 from upcast logits. "auto" is bf16 on a CUDA device that has bf16 arithmetic and fp32 elsewhere:
on a CPU, bf16 autocast is slower than fp32 where there are no bf16 matrix units and saves memory nobody is short
of, and the CPU tests compare runs bit for bit in fp32 (resolve_precision; issue #18).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch
from torch.nn.parallel import DistributedDataParallel

from islands.data.batches import compute_loss, size as batch_size, split


class Plan(Protocol):
    """What the step keeps of the sizer's MemoryPlan (islands.memory.sizer imports this module, not the reverse)."""

    def as_dict(self) -> dict: ...


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "auto": None}  # auto: resolve_precision on the model's device


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")


def resolve_precision(precision: str, device: torch.device | str) -> str:
    """ "auto" -> "bf16" on a CUDA device with bf16 support, else "fp32"; fp32 and bf16 stay as they are."""
    check_precision(precision)
    if precision != "auto":
        return precision
    device = torch.device(device)
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


class ForwardBackward:
    """Call it with (model, batch, loss_fn): runs forward and backward, returns the batch's mean loss (detached).

    Batches are any structure islands.data.batches understands (tensor, (inputs..., targets), dict);
    `loss_fn(prediction, targets)` must return a mean over the samples (or tokens, equal per sample), or be
    None for a model whose output carries its loss.
    """

    def __init__(self, micro_batch: int = 0, precision: str = "fp32"):
        if micro_batch < 0:
            raise ValueError(f"micro_batch must be >= 0 (0 = the whole batch at once); got {micro_batch}")
        check_precision(precision)
        self.micro_batch = micro_batch
        self.precision = precision
        self.plan: Plan | None = (
            None  # the sizer's MemoryPlan when a memory budget chose micro_batch (islands.memory.build)
        )
        self.resolved: str | None = None  # what "auto" became on the model's device (set by the first step)

    def record(self) -> dict:
        """What the run record keeps about this step's memory settings."""
        out = {"micro_batch": self.micro_batch, "precision": self.precision}
        if self.precision == "auto" and self.resolved is not None:
            out["precision_resolved"] = self.resolved
        if self.plan is not None:
            out["plan"] = self.plan.as_dict()
        return out

    def pieces(self, batch: int) -> list[int]:
        """Sizes of the micro-batches a batch of `batch` samples is cut into."""
        size = self.micro_batch if 0 < self.micro_batch < batch else batch
        full, rest = divmod(batch, size)
        return [size] * full + ([rest] if rest else [])

    def loss(self, model: torch.nn.Module, batch, loss_fn: Callable | None, explain: bool = False) -> torch.Tensor:
        device = next(iter(model.parameters())).device
        if self.precision == "auto":
            self.resolved = resolve_precision("auto", device)
            dtype = PRECISIONS[self.resolved]
        else:
            dtype = PRECISIONS[self.precision]
        if dtype is None:
            return compute_loss(model, batch, loss_fn, explain)[0]
        with torch.autocast(device_type=device.type, dtype=dtype):
            return compute_loss(model, batch, _upcast(loss_fn), explain)[0]

    def __call__(self, model: torch.nn.Module, batch, loss_fn: Callable | None, explain: bool = False) -> torch.Tensor:
        sizes = self.pieces(batch_size(batch))
        if len(sizes) == 1:  # the plain step, bit for bit
            loss = self.loss(model, batch, loss_fn, explain)
            loss.backward()
            return loss.detach()
        total = None
        whole = sum(sizes)
        for i, piece in enumerate(split(batch, sizes)):
            last = i == len(sizes) - 1
            with contextlib.nullcontext() if last else no_sync(model):
                loss = self.loss(model, piece, loss_fn, explain and i == 0) * (sizes[i] / whole)
                loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None  # two or more pieces ran
        return total


def _upcast(loss_fn: Callable | None) -> Callable | None:
    """The loss in fp32 from upcast predictions, outside autocast (SOTA-118: bf16 matmuls, fp32 loss)."""
    if loss_fn is None:
        return None

    def loss32(pred, target):
        with torch.autocast(device_type=pred.device.type, enabled=False):
            return loss_fn(pred.float(), target)

    return loss32


def no_sync(model: torch.nn.Module):
    """DDP's no_sync for every micro-batch but the last; a plain module accumulates locally anyway."""
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()
