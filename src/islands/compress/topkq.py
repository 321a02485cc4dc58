"""Chunked top-k with packed indices and few-bit values: SparseLoCo's pseudo-gradient compressor.

SparseLoCo (LIT-904, SOTA-902; Sarfi, Thérien, Lidin, Belilovsky 2025) sends DiLoCo's outer deltas as
the top 1-3% of each chunk, values quantised to 2 bits, with error feedback; it reports 146x fewer
bytes than fp32 deltas (issue 19) and a loss at least as good as full-precision DiLoCo. This module is our
own construction of that payload. The flat tensor is cut into chunks of `chunk` values (4096 by
default, so a position inside a chunk needs ceil(log2 4096) = 12 bits); each chunk sends its k largest
magnitudes, k = ceil(ratio * chunk length). What travels, per tensor of n values (K = sum of the k's,
C = number of chunks, w = index bits):

    indices   index=fixed: K positions inside their chunk, w bits each, packed into ceil(K w / 8) bytes;
              index=elias-fano: each chunk's k positions sorted and Elias-Fano coded (elias_fano.py), all chunks'
              codes in one bit stream of ceil(sum of nbits(chunk length, k) / 8) bytes: ~log2(chunk / k) + 2 bits a
              position (7.4 at 89 of 4096), so 146x fits 92 of each 4096 instead of 61
    values    bits=2|4|8: K codes of `bits` bits, packed into ceil(K bits / 8) bytes,
              plus one fp32 scale per chunk (4 C bytes); bits=32: K fp32 values (4 K bytes)

Quantiser (ours). A chunk's kept values v get codes on the odd grid g in {-(L-1), ..., -1, 1, ..., L-1},
L = 2**bits levels (2 bits: -3, -1, 1, 3), by rounding v / max|v| to the nearest level; then the scale
is refitted by least squares, s = <v, g> / <g, g>, and v is sent as s g. The grid has no zero (every
kept value is large), and the refit makes the quantiser contractive: ||v - s g||^2 = ||v||^2 - <v, g>^2
/ ||g||^2 < ||v||^2 whenever v != 0, because every code has its value's sign. With the unsent entries
left unchanged, ||x - decode(compress(x))|| < ||x|| for any x != 0, which is what error feedback needs.

Combine: GATHERED. Each rank's positions differ, so payloads are all-gathered; every rank decodes
every payload and adds them, in rank order, into one dense sum (index_add of each rank's K entries,
bit for bit the dense sum of the decoded payloads), then divides by the rank count.

Error feedback is on by default (`ef=1`), with an optional `decay` of the residual (SparseLoCo decays
its error-feedback buffer each round, which then stands in for DiLoCo's outer momentum):
    x = decay * residual + delta;  send Q(topk(x));  residual = x - decoded(sent).
With decay 1 on an fp32 CPU vector TopKQ takes that add into its own pass (AddsResidual, compress_residual): each
chunk is formed, checked for NaN/Inf and has its top k selected while it is in cache, the same bits as the
separate passes.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from islands.compress import elias_fano, pages
from islands.compress.base import (
    Agreed,
    Combine,
    CompressorBase,
    Payload,
    as_fp32,
    cpu_kernels,
    non_finite_error,
    numel_of,
)
from islands.compress.bits import pack_bits, pack_uint, packed_nbytes, unpack_bits, unpack_uint

BITS = (2, 4, 8, 32)
# How positions inside a chunk travel: `fixed`, ceil(log2 chunk) bits each (SparseLoCo's 12); `elias-fano`, the
# chunk's sorted positions Elias-Fano coded (elias_fano.py: ~log2(chunk / k) + 2 bits each, a size fixed by chunk and k)
INDEX = ("fixed", "elias-fano")
# The order of a chunk's positions in an index=fixed payload: `ascending` (the default), each chunk's positions
# ascending, which a threshold selection yields directly; `torch`, torch.topk's (sorted=False) order, which the CPU
# kernels reproduce by replaying its introselect (about half as fast on the CPU; issue #34's 1 GB/s on one thread
# is met by ascending only, docs/compression.md). Both send the same entries, and the same scales wherever a
# chunk's kept values span less than 2**14 (_quantise_rows), so they decode to the same vector; order=torch is the
# one whose positions are torch.topk's (the default before issue #34 item 5).
ORDER = ("ascending", "torch")
# SparseLoCo's chunk: 4096 values, so a position inside it packs into 12 bits.
SPARSELOCO_CHUNK = 4096


def keep_count(ratio: float, length: int) -> int:
    """Entries kept of a chunk of `length` values: ceil(ratio * length), at least 1 (0 for an empty chunk)."""
    if length <= 0:
        return 0
    # the 1e-9 keeps an exact product such as 0.25 * 8 from rounding up to 3
    return max(1, min(length, math.ceil(ratio * length - 1e-9)))


def _quantise_rows(v: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Rows of kept values (R, k) -> codes (R, k) in [0, 2**bits) and a least-squares scale per row (R,).

    The scale's sums run in float64, left to right along the row (a cumulative sum's last column: the order the
    compiled pass that quantises a chunk while it is in cache, kernels._quantise_subtract_row, adds in, so the two
    give the same bits on the CPU). Each product of an fp32 value and an odd level below 2**8 is exact in float64,
    and so is the sum while a row's kept values span less than 2**14: then the scale does not depend on the order
    of the kept values at all (order=ascending and order=torch send the same scales), on any device."""
    top = float(2**bits - 1)  # L - 1: the grid's largest odd level
    peak = v.abs().amax(dim=1, keepdim=True)
    unit = v / torch.where(peak > 0, peak, torch.ones_like(peak))
    codes = torch.round((unit * top + top) / 2).clamp_(0, top)
    grid = (2 * codes - top).double()  # odd levels, each with its value's sign
    if v.shape[1] == 0:
        return codes.to(torch.uint8), torch.full((v.shape[0],), float("nan"))
    num = (v.double() * grid).cumsum(dim=1)[:, -1]
    scale = (num / (grid * grid).sum(dim=1)).float()
    return codes.to(torch.uint8), scale


def topk_rows(rows: Tensor, k: int, ascending: bool = False) -> tuple[Tensor, Tensor]:
    """(positions, values) of the k largest magnitudes of each row of an fp32 (R, G) tensor, both (R, k):
    torch.topk(rows.abs(), k, dim=1, sorted=False).indices and the rows' values there, in that order, or with each
    row's positions ascending (`ascending`, values following). On the CPU, compiled loops give the same bits
    (kernels.py): a threshold selection where the result is determined by the magnitudes alone (ascending, or
    torch's partial_sort regime, 64 k <= G, which orders by magnitude), else a replay of torch's introselect;
    rows with ties that decide the result are replayed. Elsewhere torch.topk."""
    kernels = cpu_kernels(rows)
    if kernels is None or rows.dtype != torch.float32:
        idx = torch.topk(rows.abs(), k, dim=1, sorted=False).indices
        if ascending:
            idx = idx.sort(dim=1).values
        return idx, rows.gather(1, idx)
    rows = rows.contiguous()
    idx = torch.empty(rows.shape[0], k, dtype=torch.int64)
    vals = torch.empty(rows.shape[0], k, dtype=torch.float32)
    mode = _route(kernels, k, rows.shape[1], ascending)
    if mode == kernels.REPLAY:
        kernels.topk_rows(rows.numpy(), k, idx.numpy(), vals.numpy())
        return idx, vals
    replay = torch.zeros(rows.shape[0], dtype=torch.bool)
    kernels.threshold_rows(
        rows.numpy(),
        rows.numpy().view("uint32"),
        k,
        mode == kernels.BY_VALUE,
        idx.numpy(),
        vals.numpy(),
        replay.numpy(),
    )
    _replay_rows(kernels, rows, k, ascending, idx, vals, replay)
    return idx, vals


def _route(kernels, k: int, length: int, ascending: bool) -> int:
    """Which CPU selection gives torch's result for rows of `length` keeping k: a threshold selection where the
    magnitudes alone decide it (ascending, or torch's partial_sort regime, 64 k <= length, ordered by magnitude),
    else the replay of torch's introselect."""
    if ascending:
        return kernels.ASCENDING
    return kernels.BY_VALUE if k * 64 <= length else kernels.REPLAY


def decay_fuses(decay: float) -> bool:
    """Whether kernels.decayed_add gives torch.add(g, r, alpha=decay)'s bits on this machine (a fused multiply-add
    in both, where the CPU and torch's kernel have one); False without the kernels (USE_KERNELS off, no numba)."""
    kernels = cpu_kernels(torch.zeros(1))
    return kernels is not None and 0.0 < decay < 1.0 and _decayed_add_matches(kernels, decay)


@functools.cache
def _decayed_add_matches(kernels, decay: float) -> bool:
    """decay_fuses' probe, once per decay: values where a separate multiply and add would round differently in
    about a third of the entries, a vectorised body and a tail."""
    gen = torch.Generator().manual_seed(0)
    r, g = torch.randn(4099, generator=gen), torch.randn(4099, generator=gen)
    want = torch.add(g, r, alpha=decay)
    got = torch.empty_like(r)
    kernels.decayed_add(got.numpy(), r.numpy(), g.numpy(), np.float32(decay))
    return torch.equal(got.view(torch.int32), want.view(torch.int32))


def _replay_rows(kernels, rows: Tensor, k: int, ascending: bool, idx: Tensor, vals: Tensor, replay: Tensor) -> None:
    """Fill the rows a threshold selection left to torch's order (a NaN, or ties that decide the result)."""
    if not replay.any():
        return
    which = replay.nonzero().view(-1)
    sub = rows[which]
    sub_idx = torch.empty(which.numel(), k, dtype=torch.int64)
    sub_vals = torch.empty(which.numel(), k, dtype=torch.float32)
    kernels.topk_rows(sub.numpy(), k, sub_idx.numpy(), sub_vals.numpy())
    if ascending:
        sub_idx, order = sub_idx.sort(dim=1)
        sub_vals = sub_vals.gather(1, order)
    idx[which], vals[which] = sub_idx, sub_vals


def _dequantise(codes: Tensor, scale: Tensor, bits: int) -> Tensor:
    top = float(2**bits - 1)
    return (2 * codes.to(torch.float32) - top) * scale


class TopKQ(CompressorBase):
    name = "topkq"
    combine = Combine.GATHERED
    # top-k runs on the tensor's own values (no transform), so error feedback's residual is updated in place
    sparse_in_place = True

    def __init__(
        self,
        ratio: float = 0.01,
        bits: Literal[2, 4, 8, 32] = 2,
        chunk: int = SPARSELOCO_CHUNK,
        decay: float = 1.0,
        ef: bool = True,
        index: Literal["fixed", "elias-fano"] = "fixed",
        order: Literal["ascending", "torch"] = "ascending",
    ):
        """SparseLoCo's payload: the top of each chunk, positions packed, values in a few bits. `ratio`: fraction of
        each chunk sent (SparseLoCo: 1-3%). `bits`: value codes of 2, 4 or 8 bits with one fp32 scale per chunk, or 32
        for fp32 values. `chunk`: values per chunk (4096: a position packs into 12 bits). `decay`: the error-feedback
        residual's weight each round (SparseLoCo decays it, 1 = plain error feedback). `ef`: error feedback around it
        (the residual keeps what was not selected and the quantisation error). `index`: fixed (ceil(log2 chunk) bits
        per position) or elias-fano (each chunk's sorted positions Elias-Fano coded: ~7.4 bits a position at 92 of
        4096, so the same bytes carry 1.5x the entries). `order`: under index=fixed, a chunk's positions ascending
        (ascending, the default: the faster selection on the CPU) or in torch.topk's order (torch: torch.topk's
        positions; the same entries and, but for chunks of a very wide range, scales; ORDER); elias-fano is always
        ascending."""
        super().__init__()
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"{self.name} ratio (fraction of each chunk sent) must be in (0, 1], got {ratio!r}")
        if bits not in BITS:
            raise ValueError(
                f"{self.name} bits must be one of {', '.join(map(str, BITS))} (32: fp32 values), got {bits!r}"
            )
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"{self.name} chunk (values per top-k chunk) must be an int >= 1, got {chunk!r}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(
                f"{self.name} decay (weight of the error-feedback residual) must be in (0, 1], got {decay!r}"
            )
        if decay != 1.0 and not ef:
            raise ValueError(f"{self.name} decay acts on the error-feedback residual; it needs ef=1")
        if index not in INDEX:
            raise ValueError(
                f"{self.name} index (how positions travel) must be one of {', '.join(INDEX)}, got {index!r}"
            )
        if order not in ORDER:
            raise ValueError(
                f"{self.name} order (of a chunk's positions) must be one of {', '.join(ORDER)}, got {order!r}"
            )
        self.ratio, self.bits, self.chunk, self.index, self.order = float(ratio), int(bits), int(chunk), index, order
        # (payload, positions, decoded values) of the last compress: error feedback's subtract_sent reads them
        self._sent: tuple[Payload, Tensor, Tensor] | None = None
        self.ef, self.ef_decay = bool(ef), float(decay)

    # -- the coefficient vector (identity here; the DCT variant transforms) ------------------------------------
    def coeff_count(self, numel: int) -> int:
        """Length of the vector top-k runs on, for a tensor of `numel` values."""
        return numel

    def forward(self, x: Tensor) -> Tensor:
        """Flat fp32 values -> the flat fp32 vector top-k selects from."""
        return x

    def inverse(self, y: Tensor, numel: int) -> Tensor:
        """The flat fp32 vector -> the tensor's `numel` values."""
        return y

    # -- layout ------------------------------------------------------------------------------------------------
    def layout(self, n: int) -> tuple[int, int, int, int, int]:
        """(chunk length G, full chunks, their k, tail length, its k) for a coefficient vector of n values."""
        g = max(1, min(self.chunk, n))
        full, tail = divmod(n, g)
        return g, full, keep_count(self.ratio, g), tail, keep_count(self.ratio, tail)

    def index_bits(self, n: int) -> int:
        """Bits of one position under index=fixed."""
        g = self.layout(n)[0]
        return max(1, math.ceil(math.log2(g)))

    def index_nbytes(self, n: int) -> int:
        """Bytes the positions of a coefficient vector of n values take."""
        g, full, k, tail, k_tail = self.layout(n)
        if self.index == "fixed":
            return packed_nbytes(full * k + k_tail, self.index_bits(n))
        return packed_nbytes(full * elias_fano.nbits(g, k) + elias_fano.nbits(tail, k_tail), 1)

    def kept(self, n: int) -> tuple[int, int]:
        """(entries kept K, chunks C) for a coefficient vector of n values."""
        _, full, k, tail, k_tail = self.layout(n)
        return full * k + k_tail, full + (1 if tail else 0)

    def payload_nbytes(self, shape, dtype: torch.dtype) -> int:
        n = self.coeff_count(numel_of(shape))
        if n == 0:
            return 0
        kept, chunks = self.kept(n)
        values = 4 * kept if self.bits == 32 else packed_nbytes(kept, self.bits) + 4 * chunks
        return self.index_nbytes(n) + values

    # -- compress / decode -------------------------------------------------------------------------------------
    def select(self, y: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Positions inside their chunk and the kept values, as rows of k: the full chunks' (full, k) block,
        then the tail chunk's (1, k_tail) row."""
        n = y.numel()
        g, full, k, tail, k_tail = self.layout(n)
        pos, vals = [], []
        for rows, kk in ((y[: full * g].view(full, g), k), (y[full * g :].view(1, tail), k_tail)):
            if not rows.numel():
                continue
            # elias-fano codes each row's positions ascending, as order=ascending sends them; values follow
            idx, val = topk_rows(rows, kk, ascending=self.index == "elias-fano" or self.order == "ascending")
            pos.append(idx)
            vals.append(val)
        return pos, vals

    def _pack_positions(self, pos: list[Tensor], n: int) -> Tensor:
        if self.index == "fixed":
            return pack_uint(torch.cat([p.reshape(-1) for p in pos]), self.index_bits(n))
        g, _, _, tail, _ = self.layout(n)
        lengths = (g, tail)  # pos holds the full chunks' block, then the tail's row when there is a tail
        kernels = cpu_kernels(pos[0])
        if kernels is not None:  # the same bytes, written field by field
            out = torch.zeros(self.index_nbytes(n), dtype=torch.uint8)
            start, done = 0, True
            for p, m in zip(pos, lengths):
                rows = p.to(torch.int64).contiguous()
                done = done and kernels.ef_encode_rows(
                    rows.numpy(), m, elias_fano.low_bits(m, rows.shape[1]), out.numpy(), start
                )
                start += rows.shape[0] * elias_fano.nbits(m, rows.shape[1])
            if done:
                return out
        return pack_bits(torch.cat([elias_fano.encode_rows(p, m).reshape(-1) for p, m in zip(pos, lengths)]))

    def _unpack_positions(self, packed: Tensor, n: int) -> Tensor:
        """Positions inside their chunk, (K,) int64, full chunks first, then the tail's."""
        g, full, k, tail, k_tail = self.layout(n)
        if self.index == "fixed":
            return unpack_uint(packed, self.index_bits(n), full * k + k_tail)
        head = full * elias_fano.nbits(g, k)
        kernels = cpu_kernels(packed)
        if kernels is not None and packed.dtype == torch.uint8 and packed.numel() == self.index_nbytes(n):
            out = torch.empty(full * k + k_tail, dtype=torch.int64)
            data = packed.contiguous().numpy()
            blocks = ((0, full, g, k, out[: full * k]), (head, 1 if tail else 0, tail, k_tail, out[full * k :]))
            if all(
                kernels.ef_decode_rows(data, at, rows, m, kk, elias_fano.low_bits(m, kk), part.view(rows, kk).numpy())
                for at, rows, m, kk, part in blocks
                if rows
            ):
                return out
        bits = unpack_bits(packed, head + elias_fano.nbits(tail, k_tail))
        parts = [elias_fano.decode_rows(bits[:head].view(full, -1), g, k).reshape(-1)] if full else []
        if tail:
            parts.append(elias_fano.decode_rows(bits[head:].view(1, -1), tail, k_tail).reshape(-1))
        return torch.cat(parts)

    def compress(self, tensor: Tensor, state: dict, agreed: Agreed | None = None) -> Payload:
        x = as_fp32(tensor).reshape(-1)
        y = self.forward(x)
        n = y.numel()
        if n == 0:
            empty = torch.zeros(0, dtype=torch.uint8, device=x.device)
            return Payload(
                [empty, empty] + ([] if self.bits == 32 else [torch.zeros(0, device=x.device)]),
                tensor.shape,
                tensor.dtype,
            )
        pos, vals = self.select(y)
        return self._encode(pos, vals, n, tensor)

    def _encode(
        self,
        pos: list[Tensor],
        vals: list[Tensor],
        n: int,
        tensor: Tensor,
        coded: list[tuple[Tensor, Tensor]] | None = None,
    ) -> Payload:
        """The payload of the selected rows (`select`'s lists) of a coefficient vector of n values of `tensor`;
        `coded`: their (codes, scales) where they are made already (then the caller has taken what they decode
        to from its residual, and nothing is kept for subtract_sent)."""
        index = self._pack_positions(pos, n)
        keep = self.sparse_in_place and coded is None
        if self.bits == 32:
            sent = torch.cat([v.reshape(-1) for v in vals]).contiguous()
            payload = Payload([index, sent], tensor.shape, tensor.dtype)
        else:
            if coded is None:
                coded = [_quantise_rows(v, self.bits) for v in vals]
            codes = pack_uint(torch.cat([c.reshape(-1) for c, _ in coded]), self.bits)
            scales = torch.cat([s for _, s in coded]).to(torch.float32)
            payload = Payload([index, codes, scales], tensor.shape, tensor.dtype)
            if keep:
                sent = torch.cat([_dequantise(c, s.view(-1, 1), self.bits).reshape(-1) for c, s in coded])
        self._sent = None
        if keep:  # what entries(payload) would decode, kept for subtract_sent
            g = self.layout(n)[0]
            rows = [torch.arange(p.shape[0], device=p.device).view(-1, 1) * g for p in pos]
            if len(rows) == 2:  # the tail chunk's row comes after the full ones
                rows[1] += pos[0].shape[0] * g
            self._sent = (payload, torch.cat([(p + r).reshape(-1) for p, r in zip(pos, rows)]), sent)
        return payload

    # -- error feedback's add in the selection's pass (AddsResidual) --------------------------------------------
    def adds_residual(self, delta: Tensor, decay: float) -> bool:
        """True where compress_residual can run: top-k on the values themselves (no transform), a residual weight
        of 1 or one whose decayed add the compiled loop rounds as torch does on this machine (decay_fuses), a
        non-empty contiguous fp32 CPU delta and the compiled kernels."""
        return (
            self.sparse_in_place
            and (decay == 1.0 or decay_fuses(decay))
            and delta.dtype == torch.float32
            and delta.numel() > 0
            and delta.is_contiguous()
            and cpu_kernels(delta) is not None
        )

    def compress_residual(
        self, residual: Tensor, delta: Tensor, out: Tensor, state: dict, decay: float = 1.0
    ) -> Payload:
        """compress(residual + delta) (decay * residual + delta, with torch.add's fused multiply-add, at a decay
        below 1: adds_residual), with x written into `out` chunk by chunk and each chunk's
        top k selected, quantised and taken from x while it is in cache (one pass over memory where the add, the
        finiteness check, the selection and the residual's update took four); `out` is then x - decompress(payload),
        what error feedback keeps. Bit for bit the payload and residual of torch.add + compress + subtract_sent.
        NonFiniteGradientError (residual untouched, out partly written) when delta holds a NaN or Inf."""
        kernels = cpu_kernels(delta)
        n = delta.numel()
        g, full, k, tail, k_tail = self.layout(n)
        flat = [t.reshape(-1) for t in (residual, delta, out)]
        ascending = self.index == "elias-fano" or self.order == "ascending"
        pos, vals, coded = [], [], []
        for start, count, length, kk in ((0, full, g, k), (full * g, 1, tail, k_tail)):
            if not count * length:
                continue
            r, d, o = (t[start : start + count * length].view(count, length) for t in flat)
            idx = torch.empty(count, kk, dtype=torch.int64)
            val = torch.empty(count, kk, dtype=torch.float32)
            codes = torch.empty(count, kk, dtype=torch.uint8)
            scales = torch.empty(count, dtype=torch.float32)
            done = torch.zeros(count, dtype=torch.uint8)
            dn, on = d.numpy(), o.numpy()
            mode = _route(kernels, kk, length, ascending)
            args = (r.numpy(), dn, dn.view("uint32"), on, on.view("uint32"), np.float32(decay), kk, mode, self.bits)
            if not kernels.add_select_rows(
                *args, idx.numpy(), val.numpy(), codes.numpy(), scales.numpy(), done.numpy()
            ):
                raise non_finite_error(state.get("_name", "tensor"), delta)
            _replay_rows(kernels, o, kk, ascending, idx, val, done == kernels.ROW_UNSELECTED)
            self._finish_rows(o, idx, val, codes, scales, done != kernels.ROW_DONE)
            pos.append(idx)
            vals.append(val)
            coded.append((codes, scales))
        return self._encode(pos, vals, n, delta, coded)

    def _finish_rows(self, rows: Tensor, idx: Tensor, val: Tensor, codes: Tensor, scales: Tensor, left: Tensor) -> None:
        """The selected rows the one-pass kernel did not quantise (`left`: a row it could not select, or one with a
        kept value that is not finite): their codes and scales made with torch ops, and what they decode to taken
        from `rows`."""
        if not left.any():
            return
        which = left.nonzero().view(-1)
        sub_idx, sub_val = idx[which], val[which]
        if self.bits == 32:
            sent = sub_val
        else:
            sub_codes, sub_scales = _quantise_rows(sub_val, self.bits)
            codes[which], scales[which] = sub_codes, sub_scales
            sent = _dequantise(sub_codes, sub_scales.view(-1, 1), self.bits)
        where = (sub_idx + which.view(-1, 1) * rows.shape[1]).reshape(-1)
        rows.view(-1).index_add_(0, where, sent.reshape(-1), alpha=-1)

    def entries(self, payload: Payload) -> tuple[Tensor, Tensor]:
        """(positions in the coefficient vector (K,) int64, decoded fp32 values (K,)) of one payload."""
        n = self.coeff_count(numel_of(payload.shape))
        device = payload.tensors[0].device
        if n == 0:
            return torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(0, device=device)
        g, full, k, tail, k_tail = self.layout(n)
        kept, _ = self.kept(n)
        local = self._unpack_positions(payload.tensors[0], n)
        # chunk r's entries are local + r g: the full chunks as one (full, k) block, then the tail's k_tail
        where = local.clone()
        where[: full * k].view(full, k).add_(torch.arange(full, device=device).view(-1, 1) * g)
        where[full * k :] += full * g
        if self.bits == 32:
            return where, payload.tensors[1].to(torch.float32)
        codes = unpack_uint(payload.tensors[1], self.bits, kept)
        scales = payload.tensors[2].to(torch.float32)
        values = torch.empty(kept, dtype=torch.float32, device=device)
        values[: full * k].view(full, k).copy_(
            _dequantise(codes[: full * k].view(full, k), scales[:full].view(-1, 1), self.bits)
        )
        values[full * k :] = _dequantise(codes[full * k :], scales[full:], self.bits)
        return where, values

    def subtract_sent(self, x: Tensor, payload: Payload) -> Tensor:
        """x - decompress(payload), in place on x where the vector top-k ran on is x itself: only the K sent
        entries change (x - 0 elsewhere is x), so one scatter of K values replaces a dense decode and subtraction."""
        if not self.sparse_in_place or payload.dtype != torch.float32 or not x.is_contiguous():
            return super().subtract_sent(x, payload)
        sent = self._sent
        where, values = (sent[1], sent[2]) if sent is not None and sent[0] is payload else self.entries(payload)
        x.view(-1).index_add_(0, where, values, alpha=-1)  # x + (-v) is x - v, and -1 v is exact
        return x

    def _decode_into(self, payloads: list[Payload], n: int, add: bool) -> Tensor:
        """A fresh fp32 vector of n values holding the payloads' entries, in payload order: added (`add`; the sum of
        the decoded payloads) or, for one payload, copied. On the CPU one compiled pass writes each chunk zeroed
        and then its entries (kernels.decode_topkq, which reads fixed-width positions: elias-fano's are decoded and
        repacked first), the same bits as zeros + index_add_ / index_copy_, which run elsewhere (and for a payload
        whose sizes or positions are not a vector of n's)."""
        device = payloads[0].tensors[0].device if payloads[0].tensors else None
        kernels = cpu_kernels(payloads[0].tensors[0]) if n and payloads[0].tensors else None
        if kernels is not None and all(self._well_formed(p, n) for p in payloads):
            g, full, k, _, _ = self.layout(n)
            rows = [torch.stack([p.tensors[i] for p in payloads]) for i in range(len(payloads[0].tensors))]
            index: Tensor | None = rows[0]
            if self.index == "elias-fano":  # the kernel reads fixed-width positions: each payload's, repacked
                fixed = [self._fixed_index(p.tensors[0], n) for p in payloads]
                index = None if any(f is None for f in fixed) else torch.stack([f for f in fixed if f is not None])
            codes, scales, values = (
                (rows[0], torch.zeros(1, 1), rows[1]) if self.bits == 32 else (rows[1], rows[2], torch.zeros(1, 1))
            )
            if index is not None:
                out = pages.empty(n, device=device)  # every value written by the kernel's chunk-by-chunk zero fill
                args = (index.numpy(), self.index_bits(n), codes.numpy(), self.bits, scales.numpy(), values.numpy())
                if kernels.decode_topkq(*args, self.kept(n)[0], g, k, full, out.numpy(), add):
                    return out
        out = pages.zeros(n, device=device)
        for p in payloads:
            where, vals = self.entries(p)
            (out.index_add_ if add else out.index_copy_)(0, where, vals)
        return out

    def _fixed_index(self, packed: Tensor, n: int) -> Tensor | None:
        """An index=elias-fano payload's positions as index=fixed would pack them (index_bits(n) bits each); None
        where one is past its chunk's length (a damaged payload: the torch path takes it, as it did before)."""
        local = self._unpack_positions(packed, n)
        g, full, k, tail, _ = self.layout(n)
        if (full and int(local[: full * k].max()) >= g) or (tail and int(local[full * k :].max()) >= tail):
            return None
        return pack_uint(local, self.index_bits(n))

    def _well_formed(self, payload: Payload, n: int) -> bool:
        """Whether the payload's tensors have the sizes and dtypes a vector of n values gives (the compiled
        scatter reads them unchecked)."""
        kept, chunks = self.kept(n)
        want = [(torch.uint8, self.index_nbytes(n))] + (
            [(torch.float32, kept)]
            if self.bits == 32
            else [(torch.uint8, packed_nbytes(kept, self.bits)), (torch.float32, chunks)]
        )
        return len(payload.tensors) == len(want) and all(
            t.dtype == d and t.numel() == m for t, (d, m) in zip(payload.tensors, want)
        )

    def decompress(self, payload: Payload) -> Tensor:
        numel = numel_of(payload.shape)
        y = self._decode_into([payload], self.coeff_count(numel), add=False)  # distinct positions: a copy
        return self.inverse(y, numel).reshape(payload.shape).to(payload.dtype)

    def sum_gathered(self, payloads: list[Payload]) -> Tensor:
        """The sum of every rank's decoded payload, fp32, in the coefficient domain: each rank's K entries
        added in rank order (the same bits as adding the dense decoded vectors, on every rank)."""
        return self._decode_into(payloads, self.coeff_count(numel_of(payloads[0].shape)), add=True)

    def combine_gathered(self, payloads: list[Payload]) -> Tensor:
        first = payloads[0]
        mean = self.sum_gathered(payloads)
        if len(payloads) > 1:  # x / 1 is x: one pass fewer for a lone payload
            mean.div_(len(payloads))
        return self.inverse(mean, numel_of(first.shape)).reshape(first.shape).to(first.dtype)
