"""topkq's one-pass error feedback (AddsResidual, issue #34): the compiled add + NaN check + top-k gives the payload
and residual of ErrorFeedback's separate passes bit for bit, round after round; and the chunk-by-chunk decode
keeps the torch path's bits where a payload is not what the compressor makes."""

from __future__ import annotations

import pytest
import torch

import islands.compress.base as base
from islands.compress import NonFiniteGradientError, parse_compressor
from islands.compress.base import AddsResidual, Payload
from islands.compress.dct import DCTTopK
from islands.compress.error_feedback import ErrorFeedback
from islands.compress.topkq import TopKQ, decay_fuses

SPECS = [
    "topkq:ratio=0.0215,bits=2,order=torch",  # 64 k > 4096: torch's introselect replayed
    "topkq:ratio=0.0215,bits=2,order=ascending",  # (the default) threshold selection, positions ascending
    "topkq:ratio=0.01,bits=2,order=torch",  # 64 k <= 4096: threshold selection ordered by magnitude
    "topkq:ratio=0.0215,index=elias-fano",
    "topkq:ratio=0.05,bits=4,chunk=1000,order=torch",
    "topkq:ratio=0.02,bits=32,order=ascending",
    "topkq:ratio=0.0215,bits=2,decay=0.95",  # SparseLoCo's decayed residual: the add is a fused multiply-add
    "topkq:ratio=0.0215,index=elias-fano,decay=0.9,order=torch",
]
SIZES = [1, 5, 4095, 4096, 4097, 3 * 4096 + 17, 50_001]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _pair(spec: str) -> tuple[ErrorFeedback, ErrorFeedback]:
    """The spec's error feedback with the add in the compressor's pass, and with the separate passes."""
    fused = parse_compressor(spec)
    inner = parse_compressor(spec).inner
    return fused, ErrorFeedback(inner, decay=fused.decay, fuse=False)


def _deltas(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    ties = torch.round(x * 2) / 2  # equal magnitudes at and across the k-th place
    sparse = torch.where(x.abs() < 1.5, torch.zeros_like(x), x)  # zeros tie for the last places
    # magnitudes spread over 10 decades: a chunk's kept values span far more than 2**14, where the scale's float64
    # sum rounds and its order (left to right, in both passes) decides its bits
    wide = torch.randn(n, generator=g) * torch.pow(10.0, 10 * torch.rand(n, generator=g) - 5)
    return [x, ties, sparse, torch.zeros(n), -torch.zeros(n), torch.randn(n, generator=g) * 1e-3, wide]


@pytest.fixture(autouse=True)
def kernels_on(monkeypatch):
    monkeypatch.setattr(base, "USE_KERNELS", True)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", SIZES)
def test_one_pass_payload_and_residual_are_the_separate_passes(spec, n):
    fused, separate = _pair(spec)
    for rnd, delta in enumerate(_deltas(n, n)):
        assert fused._adder(delta) is not None and separate._adder(delta) is None
        p = fused.compress(delta, fused.state("w", delta), None)
        q = separate.compress(delta, separate.state("w", delta), None)
        assert len(p.tensors) == len(q.tensors), rnd
        assert all(_same(a, b) for a, b in zip(p.tensors, q.tensors)), rnd
        assert _same(fused.states["w"]["residual"], separate.states["w"]["residual"]), rnd
        assert _same(fused.combine_gathered([p]), separate.combine_gathered([q])), rnd
    # the buffers alternate as before: the spare is last round's residual, never the payload's memory
    st = fused.states["w"]
    assert st["_spare"] is not None and st["_spare"].data_ptr() != st["residual"].data_ptr()


def test_one_pass_matches_where_the_add_overflows_to_inf():
    fused, separate = _pair("topkq:ratio=0.0215,bits=32,order=ascending")
    delta = torch.randn(2 * 4096 + 9, generator=torch.Generator().manual_seed(4))
    for ef in (fused, separate):
        ef.state("w", delta)["residual"][::50] = 3e38
    big = delta.clone()
    big[::50] = 3e38  # 3e38 + 3e38 is Inf in fp32
    p = fused.compress(big, fused.state("w", big))
    q = separate.compress(big, separate.state("w", big))
    assert all(_same(a, b) for a, b in zip(p.tensors, q.tensors))
    assert torch.isinf(p.tensors[1]).any()
    assert _same(fused.states["w"]["residual"], separate.states["w"]["residual"])


@pytest.mark.parametrize("spec", ["topkq:ratio=0.0215,bits=2,order=ascending", "topkq:ratio=0.0215,bits=4,order=torch"])
def test_one_pass_matches_where_a_quantised_chunk_overflows_to_inf(spec):
    """A chunk whose peak is Inf is quantised by torch ops after the compiled pass (its codes are whatever torch's
    NaN-to-integer conversion gives); the payload and residual still match the separate passes."""
    fused, separate = _pair(spec)
    delta = torch.randn(3 * 4096 + 9, generator=torch.Generator().manual_seed(5))
    for ef in (fused, separate):
        ef.state("w", delta)["residual"][4096 + 17] = 3e38
    big = delta.clone()
    big[4096 + 17] = 3e38  # 3e38 + 3e38 is Inf in fp32: chunk 1's peak
    p = fused.compress(big, fused.state("w", big))
    q = separate.compress(big, separate.state("w", big))
    assert all(_same(a, b) for a, b in zip(p.tensors, q.tensors))
    assert not torch.isfinite(p.tensors[2][1]) and torch.isfinite(p.tensors[2][[0, 2, 3]]).all()
    assert _same(fused.states["w"]["residual"], separate.states["w"]["residual"])


@pytest.mark.parametrize("spec", ["topkq:ratio=0.0215,bits=2,order=torch", "topkq:ratio=0.0215,bits=32,order=torch"])
def test_one_pass_matches_where_the_residual_carries_a_nan(spec):
    """A NaN or Inf an earlier overflow left in the residual is kept by torch's introselect (order=torch, which does
    not replay such rows); the compiled pass leaves those chunks to torch's ops, so the payload and residual still
    match the separate passes (the NaN-to-code conversion is torch's to define)."""
    fused, separate = _pair(spec)
    delta = torch.randn(3 * 4096 + 9, generator=torch.Generator().manual_seed(5))
    for ef in (fused, separate):
        residual = ef.state("w", delta)["residual"]
        residual[4096 + 17], residual[100], residual[101] = float("nan"), float("inf"), -float("inf")
    p = fused.compress(delta, fused.state("w", delta))
    q = separate.compress(delta, separate.state("w", delta))
    assert all(_same(a, b) for a, b in zip(p.tensors, q.tensors))
    assert _same(fused.states["w"]["residual"], separate.states["w"]["residual"])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_one_pass_refuses_a_non_finite_delta_and_keeps_the_residual(bad):
    fused, separate = _pair("topkq:ratio=0.0215,bits=2,order=ascending")
    delta = torch.randn(3 * 4096 + 1, generator=torch.Generator().manual_seed(2))
    fused.compress(delta, fused.state("w", delta))
    before = fused.states["w"]["residual"].clone()
    broken = delta.clone()
    broken[2 * 4096 + 7] = bad  # in the last full chunk: the chunks before it are already written
    messages = []
    for ef in (fused, separate):
        with pytest.raises(NonFiniteGradientError) as err:
            ef.compress(broken, ef.state("w", broken))
        messages.append(str(err.value))
    assert messages[0] == messages[1] and "1 NaN/Inf" in messages[0]
    assert _same(fused.states["w"]["residual"], before)
    # and the next round goes on from that residual, as the separate passes do
    separate.states["w"]["residual"] = before.clone()
    p = fused.compress(delta, fused.state("w", delta))
    q = separate.compress(delta, separate.state("w", delta))
    assert all(_same(a, b) for a, b in zip(p.tensors, q.tensors))
    assert _same(fused.states["w"]["residual"], separate.states["w"]["residual"])


def test_agree_is_empty_and_compress_after_it_is_the_same():
    fused, separate = _pair("topkq:ratio=0.0215,bits=2")
    delta = torch.randn(10_000, generator=torch.Generator().manual_seed(6))
    assert fused.agree(delta, fused.state("w", delta)) == []
    assert "_corrected" not in fused.states["w"]
    assert separate.agree(delta, separate.state("w", delta)) == []
    p = fused.compress(delta, fused.state("w", delta))
    q = separate.compress(delta, separate.state("w", delta))
    assert all(_same(a, b) for a, b in zip(p.tensors, q.tensors))


def test_who_adds_the_residual():
    assert isinstance(TopKQ(), AddsResidual)
    x = torch.randn(100)
    assert TopKQ().adds_residual(x, 1.0)
    # a decayed add is torch's fused multiply-add: taken where the compiled one rounds alike on this machine
    assert TopKQ().adds_residual(x, 0.95) == decay_fuses(0.95)
    assert not TopKQ().adds_residual(x.double(), 1.0) and not TopKQ().adds_residual(x[::2], 1.0)
    assert not DCTTopK().adds_residual(x, 1.0)  # the residual lives in the tensor's domain, top-k in the DCT's
    assert (parse_compressor("topkq:decay=0.95")._adder(x) is not None) == decay_fuses(0.95)
    assert parse_compressor("topkq")._adder(x.to(torch.bfloat16)) is None
    base.USE_KERNELS = False  # undone by the fixture's monkeypatch
    assert parse_compressor("topkq")._adder(x) is None


def test_a_decayed_add_the_compiled_loop_cannot_match_keeps_the_separate_passes(monkeypatch):
    """On a machine where kernels.decayed_add would not round as torch's multiply-add does (no FMA in one of them),
    the probe says so and error feedback keeps the separate passes; on this one it matches, so the probe's True
    is what the one-pass tests above rely on."""
    import islands.compress.topkq as topkq

    assert decay_fuses(0.95)  # FMA in both here (x86-64 with AVX2 or AVX-512)
    base.USE_KERNELS = False  # undone by the fixture's monkeypatch: no kernels, no fused decay, and nothing cached
    assert not decay_fuses(0.95)
    base.USE_KERNELS = True
    assert decay_fuses(0.95)
    monkeypatch.setattr(topkq, "decay_fuses", lambda decay: False)
    x = torch.randn(100)
    assert not TopKQ().adds_residual(x, 0.95) and TopKQ().adds_residual(x, 1.0)
    assert parse_compressor("topkq:decay=0.95")._adder(x) is None


def test_decode_of_a_payload_with_a_position_past_its_chunk_is_the_torch_paths(monkeypatch):
    c = TopKQ(ratio=0.02, bits=2, chunk=100)  # 7-bit positions: a field can say 127 in a chunk of 100
    x = torch.randn(100 * 5 + 10, generator=torch.Generator().manual_seed(8))
    p = c.compress(x, {})
    index = p.tensors[0].clone()
    index[0] |= 0x7F  # the first chunk's first position: 127, in the second chunk's span
    bad = Payload([index, *p.tensors[1:]], p.shape, p.dtype)
    off_end = Payload([torch.full_like(index, 0xFF), *p.tensors[1:]], p.shape, p.dtype)  # the tail's: past n
    got = [c.decompress(bad), c.combine_gathered([p, bad])]
    with pytest.raises((IndexError, RuntimeError)) as on:
        c.decompress(off_end)
    monkeypatch.setattr(base, "USE_KERNELS", False)
    assert _same(got[0], c.decompress(bad)) and _same(got[1], c.combine_gathered([p, bad]))
    with pytest.raises(on.type):
        c.decompress(off_end)
