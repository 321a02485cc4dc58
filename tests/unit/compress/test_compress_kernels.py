"""The fast paths of the outer compressors (topkq, dct-topk, randomk-shared, int8/int4, error feedback) give, bit
for bit, what their implementations gave before them (kept below as the reference, unoptimised), on the compiled
CPU kernels and on the torch ops that run on any device: payload tensors, decoded tensors, residuals."""

from __future__ import annotations

import math

import pytest
import torch

import islands.compress.base as base
from islands.compress import Agreed, elias_fano, parse_compressor
from islands.compress.bits import pack_uint, packed_nbytes, unpack_uint
from islands.compress.dct import DCTTopK
from islands.compress.quantize import SharedScaleQuant
from islands.compress.topkq import TopKQ, _quantise_rows, topk_rows

# ---- the reference: the code as it was before the fast paths -------------------------------------------------


def ref_pack_bits(bits):
    n = bits.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8)
    padded[:n] = bits.reshape(-1).to(torch.uint8)
    return (padded.view(-1, 8) * torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)).sum(
        dim=1, dtype=torch.uint8
    )


def ref_unpack_bits(packed, n):
    bits = (packed.view(-1, 1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.reshape(-1)[:n].to(torch.bool)


def ref_pack_uint(values, width):
    v = values.reshape(-1).to(torch.int64)
    if width == 8:
        return v.to(torch.uint8)
    shifts = torch.arange(width, dtype=torch.int64)
    return ref_pack_bits(((v.view(-1, 1) >> shifts) & 1).reshape(-1).to(torch.bool))


def ref_unpack_uint(packed, width, n):
    if width == 8:
        return packed.reshape(-1)[:n].to(torch.int64)
    bits = ref_unpack_bits(packed.reshape(-1), n * width).view(n, width).to(torch.int64)
    return (bits * (torch.ones(width, dtype=torch.int64) << torch.arange(width))).sum(dim=1)


def ref_select(c: TopKQ, y):
    g, full, k, tail, k_tail = c.layout(y.numel())
    pos, vals = [], []
    for rows, kk in ((y[: full * g].view(full, g), k), (y[full * g :].view(1, tail), k_tail)):
        if not rows.numel():
            continue
        idx = torch.topk(rows.abs(), kk, dim=1, sorted=False).indices
        if c.index == "elias-fano" or c.order == "ascending":
            idx = idx.sort(dim=1).values
        pos.append(idx)
        vals.append(rows.gather(1, idx))
    return pos, vals


def ref_topkq_compress(c: TopKQ, tensor):
    """TopKQ.compress as it was: (index bytes, codes bytes or fp32 values, scales)."""
    x = tensor.detach().to(torch.float32).contiguous().reshape(-1)
    y = c.forward(x)
    n = y.numel()
    pos, vals = ref_select(c, y)
    if c.index == "fixed":
        index = ref_pack_uint(torch.cat([p.reshape(-1) for p in pos]), c.index_bits(n))
    else:
        g, _, _, tail, _ = c.layout(n)
        index = ref_pack_bits(torch.cat([elias_fano.encode_rows(p, m).reshape(-1) for p, m in zip(pos, (g, tail))]))
    if c.bits == 32:
        return [index, torch.cat([v.reshape(-1) for v in vals])]
    coded = [_quantise_rows(v, c.bits) for v in vals]
    codes = ref_pack_uint(torch.cat([q.reshape(-1) for q, _ in coded]), c.bits)
    return [index, codes, torch.cat([s for _, s in coded])]


def ref_topkq_entries(c: TopKQ, tensors, numel):
    n = c.coeff_count(numel)
    g, full, k, tail, k_tail = c.layout(n)
    kept, _ = c.kept(n)
    if c.index == "fixed":
        local = ref_unpack_uint(tensors[0], c.index_bits(n), kept)
    else:
        head = full * elias_fano.nbits(g, k)
        bits = ref_unpack_bits(tensors[0], head + elias_fano.nbits(tail, k_tail))
        parts = [elias_fano.decode_rows(bits[:head].view(full, -1), g, k).reshape(-1)]
        if tail:
            parts.append(elias_fano.decode_rows(bits[head:].view(1, -1), tail, k_tail).reshape(-1))
        local = torch.cat(parts)
    row = torch.cat([torch.arange(full).repeat_interleave(k), torch.full((k_tail,), full, dtype=torch.int64)])
    if c.bits == 32:
        values = tensors[1]
    else:
        top = float(2**c.bits - 1)
        values = (2 * ref_unpack_uint(tensors[1], c.bits, kept).to(torch.float32) - top) * tensors[2][row]
    return local + row * g, values


def ref_topkq_decompress(c: TopKQ, tensors, shape):
    numel = math.prod(shape)
    where, values = ref_topkq_entries(c, tensors, numel)
    y = torch.zeros(c.coeff_count(numel))
    y[where] = values
    return c.inverse(y, numel).reshape(shape)


def ref_topkq_combine(c: TopKQ, payloads, shape):
    numel = math.prod(shape)
    acc = torch.zeros(c.coeff_count(numel))
    for tensors in payloads:
        acc.index_add_(0, *ref_topkq_entries(c, tensors, numel))
    return c.inverse(acc / len(payloads), numel).reshape(shape)


def ref_stochastic_round(x, gen):
    low = torch.floor(x)
    u = torch.rand(x.shape, generator=gen, dtype=torch.float32)
    return low + (u < (x - low)).to(x.dtype)


def ref_shared_scale_compress(bits, x, gen, parties=1):
    """SharedScaleQuant.agree + compress as they were: (wire, scale, levels)."""
    scale = x.abs().max().reshape(1) if x.numel() else torch.zeros(1)
    s = 127 // parties if bits == 8 else 15 // (2 * parties)
    codes = torch.zeros_like(x) if float(scale) == 0.0 else ref_stochastic_round((x / scale * s).clamp(-s, s), gen)
    wire = codes.to(torch.int8) if bits == 8 else ref_pack_nibbles((codes + s).to(torch.uint8))
    return wire, scale, s


def ref_shared_scale_decompress(bits, wire, scale, s, n, summands=1):
    if bits == 8:
        codes = wire.to(torch.float32)
    else:
        nib = torch.stack([(wire & 15).to(torch.int16), (wire >> 4).to(torch.int16)], dim=1).reshape(-1)[:n]
        codes = (nib - s * summands).to(torch.float32)
    return codes * (scale / s)


def ref_pack_nibbles(codes):
    n = codes.numel()
    padded = torch.zeros(n + (n % 2), dtype=torch.uint8)
    padded[:n] = codes.reshape(-1)
    pairs = padded.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


# ---- inputs -------------------------------------------------------------------------------------------------

SIZES = [1, 2, 3, 7, 63, 64, 65, 4095, 4096, 4097, 8192, 3 * 4096 + 17, 50_001]


def _inputs(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    ties = torch.round(x * 2) / 2  # many equal magnitudes, inside and at the k-th place
    sparse = x.clone()
    sparse[x.abs() < 1.5] = 0.0  # fewer non-zeros than kept in many chunks: zeros tie for the last places
    return {"randn": x, "ties": ties, "sparse": sparse, "zeros": torch.zeros(n), "negzero": -torch.zeros(n)}


@pytest.fixture(params=[True, False], ids=["kernels", "torch-ops"])
def path(request, monkeypatch):
    monkeypatch.setattr(base, "USE_KERNELS", request.param)
    return request.param


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits (NaN payloads and the sign of zero included), same dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        width = {torch.float32: torch.int32, torch.float64: torch.int64}.get(a.dtype, torch.int16)
        return torch.equal(a.contiguous().view(width), b.contiguous().view(width))
    return torch.equal(a, b)


# ---- bit packing ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 17, 24, 31, 32])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 8, 9, 1001])
def test_pack_uint_makes_the_reference_bytes_and_reads_them_back(width, n):
    g = torch.Generator().manual_seed(width * 1000 + n)
    v = torch.randint(0, 2**width, (n,), generator=g, dtype=torch.int64)
    packed = pack_uint(v, width)
    assert _same(packed, ref_pack_uint(v, width)) and packed.numel() == packed_nbytes(n, width)
    assert _same(unpack_uint(packed, width, n), v)
    assert _same(unpack_uint(packed, width, n), ref_unpack_uint(packed, width, n))


# ---- top-k selection -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("k_of", [1, 3, 41, 64, 65, 89, 300, 4096])
def test_topk_rows_is_torch_topk_in_its_order(path, k_of):
    """The order matters: TopKQ's fixed-width payload packs positions as torch.topk returns them."""
    g = torch.Generator().manual_seed(k_of)
    for cols in (k_of, k_of + 1, 64 * k_of, 64 * k_of - 1, 4096):
        if cols < k_of or cols > 70_000:
            continue
        x = torch.randn(6, cols, generator=g)
        rows = {
            "randn": x,
            "ties": torch.round(x * 3) / 3,
            "zeros": torch.zeros_like(x),
            "nan": x.masked_fill(torch.rand(x.shape, generator=g) < 0.1, float("nan")),
            "inf": x.masked_fill(torch.rand(x.shape, generator=g) < 0.1, float("-inf")),
            # every 16th large: a strided sample overestimates the k-th magnitude when k > cols / 16
            "strided": x.index_fill(1, torch.arange(0, cols, 16), 1000.0),
        }
        for what, r in rows.items():
            ref = torch.topk(r.abs(), k_of, dim=1, sorted=False).indices
            idx, val = topk_rows(r, k_of)
            assert torch.equal(idx, ref), (what, cols)
            assert _same(val, r.gather(1, ref)), (what, cols)
            ref = ref.sort(dim=1).values  # elias-fano's order
            idx, val = topk_rows(r, k_of, ascending=True)
            assert torch.equal(idx, ref), (what, cols)
            assert _same(val, r.gather(1, ref)), (what, cols)


# ---- topkq / dct-topk ----------------------------------------------------------------------------------------

# order=torch spelt out where the reference is torch.topk's own order (the introselect replay, or the magnitude
# order of its partial_sort regime at ratio 0.01); the default, order=ascending, is spelt out too
SPECS = [
    TopKQ(ratio=0.0215, bits=2, order="torch"),
    TopKQ(ratio=0.01, bits=2, order="torch"),
    TopKQ(ratio=0.0215, bits=2, index="elias-fano"),
    TopKQ(ratio=0.0215, bits=2, order="ascending"),
    TopKQ(ratio=0.05, bits=4, chunk=1000, order="torch"),
    TopKQ(ratio=0.3, bits=8, chunk=64, index="elias-fano"),
    TopKQ(ratio=0.02, bits=32, order="torch"),
    TopKQ(ratio=1.0, bits=2, chunk=16, order="torch"),
    DCTTopK(ratio=0.0215, bits=2, order="torch"),
    DCTTopK(ratio=0.05, bits=4, block=7, chunk=100, index="elias-fano"),
    DCTTopK(ratio=0.05, bits=4, block=7, chunk=100, order="ascending"),
]


@pytest.mark.parametrize("c", SPECS, ids=lambda c: f"{c.name}-{c.ratio}-{c.bits}-{c.chunk}-{c.index}-{c.order}")
@pytest.mark.parametrize("n", SIZES)
def test_topkq_payload_and_decode_are_the_references(path, c, n):
    for what, x in _inputs(n, n).items():
        p = c.compress(x, {})
        ref = ref_topkq_compress(c, x)
        assert len(p.tensors) == len(ref) and all(_same(a, b) for a, b in zip(p.tensors, ref)), what
        assert sum(t.numel() * t.element_size() for t in p.tensors) == c.payload_nbytes(x.shape, x.dtype)
        expect = ref_topkq_decompress(c, ref, x.shape)
        assert _same(c.decompress(p), expect), what
        assert _same(c.combine_gathered([p]), ref_topkq_combine(c, [ref], x.shape)), what
        q = c.compress(-x.flip(0), {})
        assert _same(c.combine_gathered([p, q]), ref_topkq_combine(c, [ref, q.tensors], x.shape)), what
        work = x.clone()
        assert _same(c.subtract_sent(work, p), x - expect), what


@pytest.mark.parametrize("order", ["torch", "ascending"])
@pytest.mark.parametrize("shape", [(3, 5), (64, 65), (130, 4097)])
def test_topkq_keeps_the_input_dtype_and_shape(path, shape, order):
    c = TopKQ(ratio=0.0215, bits=2, order=order)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    p = c.compress(x, {})
    ref = ref_topkq_compress(c, x)
    assert all(_same(a, b) for a, b in zip(p.tensors, ref))
    expect = ref_topkq_decompress(c, ref, x.shape)
    assert _same(c.decompress(p), expect.to(torch.bfloat16))
    assert _same(c.subtract_sent(x.float(), p), x.float() - expect.to(torch.bfloat16).float())


@pytest.mark.parametrize(
    "spec",
    [
        "topkq:ratio=0.0215,bits=2,order=torch",
        "topkq:ratio=0.0215,bits=2",  # the default order, ascending
        "topkq:ratio=0.0215,index=elias-fano,decay=0.95",
    ],
)
def test_error_feedback_residuals_are_the_references_over_rounds(path, spec):
    ef = parse_compressor(spec)
    inner = ef.inner
    residual = torch.zeros(3 * 4096 + 5)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        delta = torch.randn(residual.numel(), generator=g)
        x = delta + residual if ef.decay == 1.0 else torch.add(delta, residual, alpha=ef.decay)
        ref = ref_topkq_compress(inner, x)
        p = ef.compress(delta, ef.state("w", delta))
        assert all(_same(a, b) for a, b in zip(p.tensors, ref))
        residual = x - ref_topkq_decompress(inner, ref, x.shape)
        assert _same(ef.states["w"]["residual"], residual)


def test_error_feedback_refuses_non_finite_input_as_before(path):
    ef = parse_compressor("topkq:ratio=0.0215")
    x = torch.randn(5000)
    x[17] = float("nan")
    with pytest.raises(base.NonFiniteGradientError, match="1 NaN/Inf"):
        ef.compress(x, ef.state("w", x))


def test_bare_topkq_with_nan_and_inf_gives_the_reference_payload(path):
    x = torch.randn(2 * 4096 + 3, generator=torch.Generator().manual_seed(5))
    x[::97] = float("nan")
    x[5::101] = float("inf")
    for c in (TopKQ(ratio=0.0215, order="torch"), TopKQ(ratio=0.0215), TopKQ(ratio=0.01, index="elias-fano")):
        p = c.compress(x, {})
        assert all(_same(a, b) for a, b in zip(p.tensors, ref_topkq_compress(c, x)))


# ---- int8 / int4 -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4096, 4097, 50_001])
@pytest.mark.parametrize("parties", [1, 3])
def test_shared_scale_wire_and_decode_are_the_references(path, bits, n, parties):
    c = SharedScaleQuant(bits, seed=7)
    gen = torch.Generator().manual_seed(7)
    inputs = _inputs(n, n) if n else {"empty": torch.zeros(0)}
    for what, x in inputs.items():
        st = c.state(what, x)
        agreed = Agreed(c.agree(x, st), parties)
        p = c.compress(x, st, agreed)
        wire, scale, s = ref_shared_scale_compress(bits, x, gen, parties)
        assert _same(p.tensors[0], wire) and _same(p.shared[0], scale) and p.meta["levels"] == s, what
        assert _same(c.decompress(p), ref_shared_scale_decompress(bits, wire, scale, s, n)), what
        p.summands = 2  # a sum of two ranks' codes decodes against 2 s
        assert _same(c.decompress(p), ref_shared_scale_decompress(bits, wire, scale, s, n, 2)), what


@pytest.mark.parametrize("bits", [8, 4])
def test_shared_scale_nan_and_inf_follow_the_reference(path, bits):
    c = SharedScaleQuant(bits, seed=1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1001, generator=torch.Generator().manual_seed(2))
    x[3] = float("nan")
    scale = torch.tensor([4.0])  # another rank's max: finite, so only the NaN entry is odd
    p = c.compress(x, c.state("w", x), Agreed([scale], 1))
    codes = ref_stochastic_round((x / scale * c.levels(1)).clamp(-c.levels(1), c.levels(1)), gen)
    s = c.levels(1)
    ref = codes.to(torch.int8) if bits == 8 else ref_pack_nibbles((codes + s).to(torch.uint8))
    assert _same(p.tensors[0], ref)
    x[3] = float("inf")
    assert _same(c.agree(x, {})[0], x.abs().max().reshape(1))


# ---- randomk-shared and error feedback around it -------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 4097, 50_001])
def test_randomk_shared_residual_is_x_with_the_sent_entries_zeroed(path, n):
    ef = parse_compressor("randomk-shared:ratio=0.01,seed=3")
    residual = torch.zeros(n)
    g = torch.Generator().manual_seed(n)
    for round_ in range(3):
        delta = torch.randn(n, generator=g)
        x = delta + residual
        idx = ef.inner.positions("w", round_, n)
        p = ef.compress(delta, ef.state("w", delta))
        assert _same(p.tensors[0], x[idx]) and torch.equal(p.shared[0], idx)
        residual = x.clone()
        residual[idx] = 0.0
        assert _same(ef.states["w"]["residual"], residual)
        expect = torch.zeros(n)
        expect[idx] = x[idx]
        assert _same(ef.decompress(p), expect)


@pytest.mark.parametrize("spec", ["dct-topk:ratio=0.0215,bits=2,order=torch", "dct-topk:ratio=0.0215,bits=2"])
def test_dct_topk_error_feedback_residual_is_the_reference(path, spec):
    ef = parse_compressor(spec)
    residual = torch.zeros(2 * 4096 + 100)
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        delta = torch.randn(residual.numel(), generator=g)
        x = delta + residual
        ref = ref_topkq_compress(ef.inner, x)
        p = ef.compress(delta, ef.state("w", delta))
        assert all(_same(a, b) for a, b in zip(p.tensors, ref))
        residual = x - ref_topkq_decompress(ef.inner, ref, x.shape)
        assert _same(ef.states["w"]["residual"], residual)
