"""Single-process properties of every compressor: bounds, unbiasedness, bytes, policies."""

import math
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from islands.compress import (
    QSGD,
    Cast,
    Combine,
    ErrorFeedback,
    MajorityVote,
    NoCompression,
    NonFiniteGradientError,
    PowerSGD,
    RandomK,
    ScaledSign,
    SharedScaleQuant,
    TopK,
    parse_compressor,
)
from islands.compress.bits import pack_bits, pack_nibbles, unpack_bits, unpack_nibbles

SPECS = [
    "none",
    "fp16",
    "bf16",
    "int8",
    "int4",
    "qsgd:levels=16",
    "qsgd:levels=3",
    "randomk:ratio=0.2",
    "topk:ratio=0.2,warmup=0",
    "topk:ratio=0.01,warmup=1,stage_steps=2",
    "powersgd:rank=2",
    "sign",
    "powersgd:rank=2,ef=0",
    "sign:ef=0",
    "topk:ratio=0.1,ef=0",
    # the outer strategies' pseudo-gradient compressors (issue 19)
    "topkq:ratio=0.2,bits=2,chunk=8",
    "topkq:ratio=0.1,bits=32",
    "dct-topk:ratio=0.2,bits=4,block=4,chunk=16",
    "randomk-shared:ratio=0.2",
]
SHAPES = [(5, 7), (33,), (4, 3, 2), (1,), (0,), (2, 0), (16, 16)]


def roundtrip(c, t, name="w"):
    p = c.compress(t, c.state(name, t))
    return p, c.decompress(p)


def _kw(c, step):
    inner = c.inner if isinstance(c, ErrorFeedback) else c
    return {"step": step} if isinstance(inner, TopK) else {}


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_payload_bytes_shape_dtype(spec, shape, dtype):
    c = parse_compressor(spec)
    t = torch.randn(shape).to(dtype)
    for step in range(3):  # warm-up stages change k; bytes must follow
        p, d = roundtrip(c, t)
        assert p.nbytes == c.payload_nbytes(t.shape, t.dtype, **_kw(c, step))
        assert d.shape == t.shape and d.dtype == t.dtype
        assert bool(torch.isfinite(d).all())


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-100, 100, width=32), min_size=1, max_size=64))
def test_exact_and_cast_bounds(values):
    t = torch.tensor(values)
    assert torch.equal(roundtrip(NoCompression(), t)[1], t)
    for dtype, rel, floor in ((torch.float16, 2**-11, 2**-24), (torch.bfloat16, 2**-8, 2**-126)):
        d = roundtrip(Cast(dtype), t)[1]
        # round-to-nearest: relative error <= half an ulp, plus an absolute floor for tiny values
        assert torch.all((d - t).abs() <= t.abs() * rel + floor)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-10, 10, width=32), min_size=1, max_size=64), st.sampled_from([8, 4]))
def test_shared_scale_error_within_one_level(values, bits):
    t = torch.tensor(values)
    c = SharedScaleQuant(bits)
    d = roundtrip(c, t)[1]
    step = t.abs().max() / c.levels(1)
    assert torch.all((d - t).abs() <= step * (1 + 1e-5) + 1e-6)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-10, 10, width=32), min_size=1, max_size=64), st.integers(1, 127))
def test_qsgd_error_within_one_level(values, levels):
    t = torch.tensor(values)
    d = roundtrip(QSGD(levels), t)[1]
    assert torch.all((d - t).abs() <= t.norm() / levels * (1 + 1e-5) + 1e-6)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-10, 10, width=32), min_size=1, max_size=80), st.floats(0.01, 1.0))
def test_topk_keeps_the_largest_exactly(values, ratio):
    t = torch.tensor(values)
    c = TopK(ratio)
    p, d = roundtrip(c, t)
    k = c.k(t.numel())
    kept = d != 0
    assert torch.equal(d[kept], t[kept])  # values travel exactly
    assert int(kept.sum()) <= k
    # nothing dropped is larger than anything kept
    idx = p.tensors[1].long()
    dropped = torch.ones_like(t, dtype=torch.bool)
    dropped[idx] = False
    if dropped.any():
        assert float(t[dropped].abs().max()) <= float(t[idx].abs().min())


def test_topk_warmup_schedule_is_dgc_default():
    c = TopK(0.001, warmup=True, steps_per_stage=10)
    assert [round(1 - c.density(s), 6) for s in (0, 10, 20, 30, 40, 50)] == [
        0.75,
        0.9375,
        0.984375,
        0.996,
        0.999,
        0.999,
    ]
    assert TopK(0.01, warmup=True, steps_per_stage=1).density(4) == 0.01  # never sparser than target
    with pytest.raises(ValueError):
        TopK(0.01, warmup=True, schedule=[0.9, 0.5])


def test_randomk_and_qsgd_unbiased():
    t = torch.linspace(-2, 3, 40)
    for c, draws, tol in (
        (RandomK(0.25, seed=1), 4000, 0.15),
        (QSGD(4, seed=1), 2000, 0.05),
        (SharedScaleQuant(4, seed=2), 2000, 0.05),
        (SharedScaleQuant(8, seed=3), 1000, 0.01),
    ):
        st_ = c.state("w", t)
        mean = sum(c.decompress(c.compress(t, st_)) for _ in range(draws)) / draws
        assert float((mean - t).abs().max()) < tol * float(t.abs().max()), c
    # and top-k is not: the control that the test can fail
    c = TopK(0.25)
    assert float((c.decompress(c.compress(t, c.state("w", t))) - t).abs().max()) > 0.5


def test_randomk_never_touches_global_rng():
    torch.manual_seed(123)
    before = torch.get_rng_state().clone()
    c = RandomK(0.1, seed=5)
    t = torch.randn(100, generator=torch.Generator().manual_seed(0))
    for _ in range(5):
        roundtrip(c, t)
    for c2 in (QSGD(8), SharedScaleQuant(4), parse_compressor("powersgd:rank=2")):
        roundtrip(c2, torch.ones(6, 5))
    assert torch.equal(torch.get_rng_state(), before)


def test_powersgd_exact_on_low_rank_and_warm_start_converges():
    g = torch.Generator().manual_seed(0)
    M = torch.randn(20, 2, generator=g) @ torch.randn(2, 30, generator=g)
    c = PowerSGD(rank=2)
    st_ = c.state("w", M)
    errs = [float((c.decompress(c.compress(M, st_)) - M).norm() / M.norm()) for _ in range(3)]
    assert errs[-1] < 1e-4
    assert c.matrix((10,)) is None and c.matrix((4, 4)) is None  # biases and tiny matrices: uncompressed
    b = torch.randn(10)
    assert torch.equal(roundtrip(c, b, "b")[1], b)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 70), st.integers(0, 2**31))
def test_bit_and_nibble_packing(n, seed):
    g = torch.Generator().manual_seed(seed)
    bits = torch.rand(n, generator=g) > 0.5
    packed = pack_bits(bits)
    assert packed.numel() == math.ceil(n / 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_bits(packed, n), bits)
    nib = torch.randint(0, 16, (n,), generator=g, dtype=torch.uint8)
    assert pack_nibbles(nib).numel() == math.ceil(n / 2)
    assert torch.equal(unpack_nibbles(pack_nibbles(nib), n), nib.to(torch.int16))


def test_sign_payload_is_packed_bits():
    c = ScaledSign()
    for n in (1, 8, 9, 1000):
        p = c.compress(torch.randn(n), {})
        assert p.tensors[0].numel() == math.ceil(n / 8) and p.tensors[0].dtype == torch.uint8
        assert p.nbytes == math.ceil(n / 8) + 4


def test_majority_vote_against_hand_computation():
    c = MajorityVote()
    ranks = [
        torch.tensor([1.0, -1.0, 2.0, -3.0, 0.5]),
        torch.tensor([1.0, 1.0, -2.0, -3.0, -0.5]),
        torch.tensor([-1.0, -1.0, -2.0, 3.0, 0.5]),
    ]
    payloads = [c.compress(t, {}) for t in ranks]
    # hand: coordinate votes (+,+,-) (-,+,-) (+,-,-) (-,-,+) (+,-,+) -> + - - - +
    scale = sum(float(t.abs().mean()) for t in ranks) / 3
    vote = c.vote(payloads)
    assert vote.nbytes == 1 + 4  # the vote itself is a 1-bit payload
    assert torch.allclose(c.combine_gathered(payloads), torch.tensor([1.0, -1, -1, -1, 1]) * scale)
    # two ranks disagreeing: the tie goes to the larger-scaled rank
    two = [c.compress(torch.tensor([1.0, -1.0]), {}), c.compress(torch.tensor([-3.0, 3.0]), {})]
    assert torch.equal(torch.sign(c.combine_gathered(two)), torch.tensor([-1.0, 1.0]))


def test_combine_modes_declared():
    assert NoCompression().combine is Combine.SUMMABLE and PowerSGD().combine is Combine.SUMMABLE
    assert SharedScaleQuant().combine is Combine.SUMMABLE and Cast(torch.bfloat16).combine is Combine.SUMMABLE
    for c in (TopK(), RandomK(), MajorityVote(), QSGD()):
        assert c.combine is Combine.GATHERED
    assert ErrorFeedback(PowerSGD()).combine is Combine.SUMMABLE


def test_policies_nan_empty_noncontiguous_dtype():
    c = parse_compressor("topk:ratio=0.5,warmup=0")
    bad = torch.tensor([1.0, float("nan"), 2.0])
    with pytest.raises(NonFiniteGradientError, match=re.escape("'layer.weight'")):
        c.compress(bad, c.state("layer.weight", bad))
    assert torch.equal(c.states["layer.weight"]["residual"], torch.zeros(3))  # nothing absorbed
    with pytest.raises(TypeError, match="floating"):
        NoCompression().state("i", torch.arange(3))
    with pytest.raises(ValueError, match="shape"):
        c.state("layer.weight", torch.zeros(4))
    with pytest.raises(ValueError, match="overflows fp16"):
        roundtrip(Cast(torch.float16), torch.tensor([1e6]))
    big = torch.randn(6, 8)
    nc = big.t()  # non-contiguous
    assert not nc.is_contiguous()
    for spec in SPECS:
        c1, c2 = parse_compressor(spec), parse_compressor(spec)
        a, b = roundtrip(c1, nc)[1], roundtrip(c2, nc.contiguous())[1]
        assert torch.equal(a, b), spec
        assert roundtrip(parse_compressor(spec), torch.zeros(0, 3))[1].shape == (0, 3)


def test_spec_errors_list_names_and_parameters():
    for bad in (
        "nope",
        "topk:ratio=abc",
        "powersgd:rnk=4",
        "topk:ratio=2",
        "sign:ef=2",
        "randomk:momentum=0.9",
        "topk:momentum=0.9,ef=0",
        "qsgd:levels=300",
    ):
        with pytest.raises(ValueError) as e:
            parse_compressor(bad)
        assert "powersgd:rank=4" in str(e.value) or "need ef" in str(e.value), bad  # the valid forms, or the fix
    with pytest.raises(TypeError):
        parse_compressor(4)
    c = parse_compressor("topk:ratio=0.01,momentum=0.9,clip=2.0")
    assert isinstance(c, ErrorFeedback) and c.momentum == 0.9 and c.clip_norm == 2.0 and c.inner.ratio == 0.01
    assert isinstance(parse_compressor("int8:ef=1"), ErrorFeedback)
    assert isinstance(parse_compressor("int8"), SharedScaleQuant)
