"""Robust aggregation where training really communicates: all-gather, then aggregate on every rank.

A robust aggregator cannot ride on all-reduce (a sum is already the mean), so each rank all-gathers
every rank's tensor through the counted `Comm` (bytes land in its ledger under `kind`) and runs the
same deterministic aggregator on the same inputs in the same rank order. Every rank therefore holds
the identical result without a second round trip. Identity holds bit for bit when ranks share a
device type and torch build; `check_agreement=True` verifies it with one extra 8-byte all-gather
(ledger kind "aggregate_check") and raises if any rank differs.

Aggregators that measure whole-vector distances (Krum, geometric median, NNM, centered clipping) must
see one vector per rank, not one per parameter: `robust_all_reduce_dict` concatenates named tensors
into a flat vector, aggregates it once, and splits the result back.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from islands.aggregate.base import Aggregator
from islands.runtime.comm import Comm


def _checksum(t: torch.Tensor) -> torch.Tensor:
    # Sum of the raw bit patterns as int64: any bit that differs between ranks changes it.
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    weights = torch.arange(1, raw.numel() + 1, dtype=torch.int64, device=raw.device) % 65521
    return (raw * weights).sum().reshape(1).cpu()


def robust_all_reduce(
    tensor: torch.Tensor,
    comm: Comm,
    aggregator: Aggregator,
    kind: str = "all_gather",
    check_agreement: bool = False,
) -> torch.Tensor:
    """All-gather `tensor` from every rank of `comm`, aggregate, return the same result on every rank.

    Collective: every rank of comm must call it with a tensor of the same shape and dtype. The input
    is not modified. Non-finite contributions are dropped by the aggregator (see aggregate/base.py).
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise TypeError(f"robust_all_reduce needs a floating tensor, got {getattr(tensor, 'dtype', type(tensor))}")
    gathered = comm.all_gather(tensor.detach(), kind=kind)
    result = aggregator.aggregate(gathered)
    if check_agreement and comm.size > 1:
        sums = comm.all_gather(_checksum(result), kind="aggregate_check")
        if any(int(s) != int(sums[0]) for s in sums):
            raise RuntimeError(f"ranks disagree on the aggregate: checksums {[int(s) for s in sums]}")
    return result


def flatten_named(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[torch.Tensor, list[tuple[str, torch.Size, torch.dtype]]]:
    """Concatenate named floating tensors (in mapping order) into one flat vector plus a layout."""
    if not tensors:
        raise ValueError("need at least one named tensor to flatten")
    layout, parts = [], []
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name!r} must be a floating tensor, got {getattr(t, 'dtype', type(t))}")
        layout.append((name, t.shape, t.dtype))
        parts.append(t.detach().reshape(-1))
    dtype = parts[0].dtype
    for p in parts[1:]:
        dtype = torch.promote_types(dtype, p.dtype)
    return torch.cat([p.to(dtype) for p in parts]), layout


def unflatten_named(flat: torch.Tensor, layout: list[tuple[str, torch.Size, torch.dtype]]) -> dict[str, torch.Tensor]:
    """Inverse of flatten_named: split a flat vector back into named tensors of their own dtypes."""
    total = sum(shape.numel() for _, shape, _ in layout)
    if flat.numel() != total:
        raise ValueError(f"flat vector has {flat.numel()} values but the layout needs {total}")
    out, offset = {}, 0
    for name, shape, dtype in layout:
        n = shape.numel()
        out[name] = flat[offset : offset + n].reshape(shape).to(dtype)
        offset += n
    return out


def robust_all_reduce_dict(
    tensors: Mapping[str, torch.Tensor],
    comm: Comm,
    aggregator: Aggregator,
    kind: str = "all_gather",
    check_agreement: bool = False,
) -> dict[str, torch.Tensor]:
    """robust_all_reduce over named tensors aggregated as ONE flat vector per rank, then split.

    Every rank must pass the same names, shapes and dtypes in the same order (model.named_parameters()
    order is). A NaN anywhere in a rank's tensors drops that rank's whole contribution.
    """
    flat, layout = flatten_named(tensors)
    result = robust_all_reduce(flat, comm, aggregator, kind=kind, check_agreement=check_agreement)
    return unflatten_named(result, layout)
