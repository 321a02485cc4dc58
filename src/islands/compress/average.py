"""compress_and_average: the mean of named tensors across a Comm's group, through any compressor.

Collectives per call (each counted in the Comm's ledger, kinds "compress_agree", "compress_sum",
"compress_gather"), all tensors of a call fused into one buffer per round and dtype (SOTA-048):
  SUMMABLE  one all-reduce of the agreement tensors (if the compressor has any), then one all-reduce
            of the payloads; the sum decodes to the sum of every rank's contribution.
  GATHERED  one all-gather of all payload bytes; each rank decodes every rank's payloads in rank order.
A SUMMABLE compressor whose `sum_transport` is "gather" (PowerSGD's int8 factors, whose per-rank
scales do not add on the wire) has each of its two rounds all-gathered instead (kinds unchanged) and
summed by `compressor.merge(per_rank_tensors)`, in rank order.
Every rank ends with the same bits. Bytes sent per rank == sum of compressor.payload_nbytes(...)
plus FINITE_FLAG_NBYTES per call (see below). Tensors are processed in the dict's order, which must
be the same on every rank.

NaN/Inf agreement: before anything is compressed, every rank all-reduces one 4-byte count of ranks
whose inputs are not all finite (ledger kind "compress_finite"). If it is non-zero, EVERY rank raises
NonFiniteGradientError at the same call, with nothing sent and no state touched; without it, the rank
that saw the NaN raised alone and the others blocked in their next collective until the timeout.
"""

from __future__ import annotations

import typing
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor

from islands.compress.base import (
    Agreed,
    Combine,
    Compressor,
    CompressorBase,
    NonFiniteGradientError,
    Payload,
    all_finite,
    cast,
    check_finite,
    check_float,
)
from islands.runtime.contracts import Collectives

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
FINITE_FLAG_NBYTES = 4  # one int32 per call: how many ranks saw NaN/Inf


def _tiling(tensors: list[Tensor]) -> Tensor | None:
    """One flat view covering exactly these tensors when they are contiguous pieces that tile one
    stretch of one storage with no gap or overlap (a DDP bucket cut into its parameters), else None."""
    if len(tensors) < 2 or not all(t.is_contiguous() for t in tensors):
        return None
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    if any(
        t.untyped_storage().data_ptr() != storage or t.dtype != first.dtype or t.device != first.device for t in tensors
    ):
        return None
    spans = sorted((t.storage_offset(), t.numel()) for t in tensors)
    start, end = spans[0][0], spans[0][0]
    for offset, numel in spans:
        if offset != end:
            return None
        end += numel
    return first.detach().as_strided((end - start,), (1,), start)


def _non_finite(named_tensors: dict[str, Tensor]) -> list[str]:
    """Names of the tensors holding NaN/Inf. A tiled bucket is checked in one pass (the usual, clean
    case); only when that finds something is each tensor checked to name it."""
    flat = _tiling(list(named_tensors.values()))
    if flat is not None and all_finite(flat):
        return []
    return [n for n, t in named_tensors.items() if not all_finite(t)]


def agree_all_finite(named_tensors: dict[str, Tensor], comm: Collectives) -> None:
    """Raise NonFiniteGradientError on every rank of comm's group if any rank holds a NaN/Inf.

    One tiny all-reduce (counted, kind "compress_finite"); with one rank, the local check alone.
    """
    bad = _non_finite(named_tensors)
    ranks_bad = int(bool(bad))
    if comm.size > 1:
        flag = torch.tensor([ranks_bad], dtype=torch.int32)
        ranks_bad = int(comm.all_reduce(flag, kind="compress_finite").item())
    if ranks_bad:
        for n in bad:
            check_finite(n, named_tensors[n])  # this rank's own error names the parameter and count
        raise NonFiniteGradientError(
            f"{ranks_bad} of {comm.size} rank(s) had NaN/Inf inputs to compress_and_average; this rank's "
            f"were finite, and every rank stops here together (nothing sent, no state changed). Fix the "
            "loss scale or skip the step before communication"
        )


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _flat_bytes(t: Tensor) -> Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _typed(buf: Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape) -> Tensor:
    """Bytes [offset, offset + nbytes) of a gathered buffer as a tensor: a view where the start is aligned
    for dtype, else a copy (a dtype view needs an aligned start). Views share `buf`, which is ours alone."""
    piece = buf[offset : offset + nbytes]
    if offset % dtype.itemsize:
        piece = piece.clone()
    return piece.view(dtype).reshape(shape)


def _all_reduce_fused(
    groups: dict[str, list[Tensor]], comm: Collectives, op: str, kind: str
) -> dict[str, list[Tensor]]:
    """All-reduce many small tensors as one flat buffer per dtype; returns them in the same layout."""
    out = {name: list(ts) for name, ts in groups.items()}
    by_dtype: dict[torch.dtype, list[tuple[str, int]]] = {}
    for name, ts in groups.items():
        for i, t in enumerate(ts):
            if t.numel():
                by_dtype.setdefault(t.dtype, []).append((name, i))
    for slots in by_dtype.values():
        flat = torch.cat([groups[n][i].detach().reshape(-1) for n, i in slots])
        comm.all_reduce(flat, op=_OPS[op], kind=kind)
        offset = 0
        for n, i in slots:
            t = groups[n][i]
            out[n][i] = flat[offset : offset + t.numel()].reshape(t.shape)
            offset += t.numel()
    return out


def _gather_merge_fused(
    groups: dict[str, list[Tensor]], comm: Collectives, merge, kind: str
) -> dict[str, list[Tensor]]:
    """The sum over ranks of each name's tensors when they do not add on the wire: one all-gather of
    everything's bytes, then `merge([rank 0's tensors, rank 1's, ...])` per name, in rank order."""
    layout = [
        (n, i, t.shape, t.dtype, t.numel() * t.element_size()) for n, ts in groups.items() for i, t in enumerate(ts)
    ]
    parts = [_flat_bytes(t) for ts in groups.values() for t in ts if t.numel()]
    if not parts:
        return {n: list(ts) for n, ts in groups.items()}
    everyone = comm.all_gather(torch.cat(parts), kind=kind)
    per_rank: list[dict[str, list[Tensor]]] = []
    for buf in everyone:
        mine: dict[str, list[Tensor]] = {n: [] for n in groups}
        offset = 0
        for n, _, shape, dtype, nb in layout:
            mine[n].append(_typed(buf, offset, nb, dtype, shape))
            offset += nb
        per_rank.append(mine)
    return {n: (merge([r[n] for r in per_rank]) if ts else []) for n, ts in groups.items()}


def _sum_round(
    groups: dict[str, list[Tensor]], comm: Collectives, compressor: Compressor, op: str, kind: str
) -> dict[str, list[Tensor]]:
    if getattr(compressor, "sum_transport", "all_reduce") == "gather":
        # only CompressorBase subclasses set sum_transport, and `merge` comes with it
        return _gather_merge_fused(groups, comm, typing.cast(CompressorBase, compressor).merge, kind)
    return _all_reduce_fused(groups, comm, op, kind)


def _fp32_target(out: dict[str, Tensor] | None, name: str) -> Tensor | None:
    """out[name] when a mean can be decoded straight into it (contiguous fp32), else None."""
    t = out.get(name) if out is not None else None
    return t if t is not None and t.dtype == torch.float32 and t.is_contiguous() else None


def _average_summable(
    tensors: dict[str, Tensor],
    states: dict,
    comm: Collectives,
    compressor: Compressor,
    out_to: dict[str, Tensor] | None,
    sent: list[int] | None = None,
) -> dict[str, Tensor]:
    parties = comm.size
    agree = {n: compressor.agree(t, states[n]) for n, t in tensors.items()}
    agreed = _sum_round(agree, comm, compressor, compressor.agree_op, "compress_agree")
    payloads = {n: compressor.compress(t, states[n], Agreed(agreed[n], parties)) for n, t in tensors.items()}
    if sent is not None:
        sent.append(
            sum(_nbytes(t) for ts in agree.values() for t in ts) + sum(p.wire_nbytes for p in payloads.values())
        )
    summed = _sum_round({n: p.tensors for n, p in payloads.items()}, comm, compressor, "sum", "compress_sum")
    out = {}
    for n, p in payloads.items():
        total = replace(p, tensors=summed[n], summands=parties)
        compressor.absorb(states[n], total)
        out[n] = compressor.decompress_mean(total, _fp32_target(out_to, n))
    return out


def _average_gathered(
    tensors: dict[str, Tensor], states: dict, comm: Collectives, compressor: Compressor, sent: list[int] | None = None
) -> dict[str, Tensor]:
    payloads = {n: compressor.compress(t, states[n]) for n, t in tensors.items()}
    if sent is not None:
        sent.append(sum(p.wire_nbytes for p in payloads.values()))
    layout = [
        (n, i, t.shape, t.dtype, t.numel() * t.element_size())
        for n, p in payloads.items()
        for i, t in enumerate(p.tensors)
    ]
    parts = [_flat_bytes(t) for p in payloads.values() for t in p.tensors]
    mine = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    everyone = comm.all_gather(mine, kind="compress_gather") if mine.numel() else [mine] * comm.size
    per_rank: list[dict[str, Payload]] = []
    for buf in everyone:
        rebuilt = {n: replace(p, tensors=list(p.tensors)) for n, p in payloads.items()}
        offset = 0
        for n, i, shape, dtype, nb in layout:
            rebuilt[n].tensors[i] = _typed(buf, offset, nb, dtype, shape)
            offset += nb
        per_rank.append(rebuilt)
    return {n: cast(compressor.combine_gathered([r[n] for r in per_rank]), torch.float32) for n in payloads}


def compress_and_average(
    named_tensors: dict[str, Tensor],
    comm: Collectives,
    compressor: Compressor,
    out: dict[str, Tensor] | None = None,
    sent: list[int] | None = None,
) -> dict[str, Tensor]:
    """Mean over comm's group of each named tensor, compressed on the wire; results in input dtypes.

    `out` (same names and shapes): tensors the means are written into and returned as; they may be the
    inputs themselves (the DDP hook averages a bucket in place), since inputs are read only before the
    first payload is sent. Without it, new tensors. Large means allocated per call cost page faults.
    `sent`: a list that gets one entry appended, the bytes this rank handed to the Comm in this call (the NaN/Inf
    flag, agreement tensors and payloads; with one rank nothing travels, and 0 is appended).

    Raises NonFiniteGradientError (a ValueError) naming the parameter if an input is NaN/Inf, or if
    the decoded mean is (a cast overflowed); nothing is sent for a non-finite input.
    """
    if not isinstance(named_tensors, dict):
        raise TypeError(f"named_tensors must be a dict[str, Tensor], got {type(named_tensors).__name__}")
    for name, t in named_tensors.items():
        check_float(name, t)
    if out is not None:
        _check_out(named_tensors, out)
    agree_all_finite(named_tensors, comm)
    states = {n: compressor.state(n, t) for n, t in named_tensors.items()}
    for st in states.values():
        st["_finite"] = True  # checked above on every rank: error feedback need not check again
    mine: list[int] | None = [] if sent is not None else None
    if compressor.combine is Combine.SUMMABLE:
        means = _average_summable(named_tensors, states, comm, compressor, out, mine)
    elif compressor.combine is Combine.GATHERED:
        means = _average_gathered(named_tensors, states, comm, compressor, mine)
    else:
        raise ValueError(f"{compressor!r}: combine must be Combine.SUMMABLE or Combine.GATHERED")
    if sent is not None and mine is not None:  # set together
        sent.append(FINITE_FLAG_NBYTES + mine[0] if comm.size > 1 else 0)
    if out is not None:
        for n, t in out.items():
            if means[n] is not t:
                t.copy_(means[n].reshape(t.shape))
        means = out
    for n in _non_finite(means):
        check_finite(n, means[n], where="averaged result")
    if out is not None:
        return out
    return {n: cast(means[n].reshape(t.shape), t.dtype) for n, t in named_tensors.items()}


def _check_out(named_tensors: dict[str, Tensor], out: dict[str, Tensor]) -> None:
    if list(out) != list(named_tensors) or any(
        (out[n].shape, out[n].dtype) != (t.shape, t.dtype) for n, t in named_tensors.items()
    ):
        raise ValueError(
            "compress_and_average: out must hold the same names, in the same order, with the same "
            f"shapes and dtypes as named_tensors; got {[(n, tuple(t.shape), t.dtype) for n, t in out.items()]}"
        )


def analytic_nbytes(named_tensors: dict[str, Tensor], compressor: Compressor, **kw) -> int:
    """Bytes one rank sends for one compress_and_average call on these tensors (world size > 1)."""
    return FINITE_FLAG_NBYTES + sum(compressor.payload_nbytes(t.shape, t.dtype, **kw) for t in named_tensors.values())
