"""PowerSGD's options and numerics (single process): uncompressed start, min_rate, Q orthonormalisation,
and the cheap NaN/Inf check every compress call relies on."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from islands.compress import ErrorFeedback, PowerSGD, parse_compressor
from islands.compress.base import all_finite
from islands.compress.powersgd import orthonormal


def _steps(c, t, n, name="w"):
    return [c.compress(t, c.state(name, t)) for _ in range(n)]


def test_start_sends_whole_tensors_then_factors_and_counts_bytes():
    c = PowerSGD(rank=2, start=3)
    t = torch.randn(12, 10, generator=torch.Generator().manual_seed(1))
    payloads = _steps(c, t, 5)
    for step, p in enumerate(payloads):
        assert p.nbytes == c.payload_nbytes(t.shape, t.dtype, step=step), step
    assert [p.nbytes for p in payloads] == [480, 480, 480, (12 + 10) * 2 * 4, (12 + 10) * 2 * 4]
    assert all(torch.equal(c.decompress(p), t) for p in payloads[:3])  # exact while uncompressed
    assert payloads[3].shared and not payloads[2].shared
    assert c.payload_nbytes(t.shape, t.dtype) == (12 + 10) * 2 * 4  # step unknown: the steady state


def test_start_leaves_no_residual_and_q_untouched_until_compression():
    ef = parse_compressor("powersgd:rank=2,start=2")
    t = torch.randn(9, 8, generator=torch.Generator().manual_seed(2))
    q0 = ef.inner.state("w", t)["Q"].clone()
    for _ in range(2):
        ef.compress(t, ef.state("w", t))
        assert torch.equal(ef.states["w"]["residual"], torch.zeros_like(t))
    assert torch.equal(ef.inner.states["w"]["Q"], q0)
    ef.compress(t, ef.state("w", t))
    assert float(ef.states["w"]["residual"].abs().max()) > 0  # rank 2 of a random 9 x 8 matrix is lossy
    assert ef.inner.states["w"]["step"] == 3


def test_start_step_survives_checkpoint():
    c = PowerSGD(rank=2, start=2)
    t = torch.randn(7, 6)
    _steps(c, t, 1)
    c2 = PowerSGD(rank=2, start=2)
    c2.load_state_dict(c.state_dict())
    assert not c2.compress(t, c2.state("w", t)).shared  # still the second uncompressed step
    assert c2.compress(t, c2.state("w", t)).shared


def test_min_rate_follows_torch_rule():
    # 16 x 16 at rank 2: 256 values vs 64 in factors, a rate of exactly 4
    assert PowerSGD(2, min_rate=3.9).matrix((16, 16)) == (16, 16, 2)
    assert PowerSGD(2, min_rate=4.0).matrix((16, 16)) is None  # torch compresses only when rate > min_rate
    assert PowerSGD(2).matrix((4, 4)) is None and PowerSGD(2).matrix((10,)) is None
    assert PowerSGD(2, min_rate=100).payload_nbytes((16, 16), torch.float32) == 1024


def test_warm_start_resolves_small_singular_values():
    """Singular values 1 .. 1e-4 (a steep gradient spectrum): after a few warm-started steps even the
    smallest component comes through the fp32 factorisation."""
    g = torch.Generator().manual_seed(3)
    U = orthonormal(torch.randn(64, 4, generator=g))
    V = orthonormal(torch.randn(48, 4, generator=g))
    M = U @ torch.diag(torch.tensor([1.0, 1e-2, 1e-3, 1e-4])) @ V.t()
    c = PowerSGD(rank=4)
    for _ in range(6):
        out = c.decompress(c.compress(M, c.state("w", M)))
    assert float((out - M).norm()) < 1e-5  # well below the 1e-4 component


@pytest.mark.parametrize("bad", ["powersgd:start=-1", "powersgd:start=1.5", "powersgd:min_rate=0.5", "powersgd:rank=0"])
def test_bad_powersgd_specs_raise_clearly(bad):
    with pytest.raises(ValueError) as e:
        parse_compressor(bad)
    assert "powersgd" in str(e.value)


def test_spec_sets_start_and_min_rate():
    c = parse_compressor("powersgd:rank=3,start=5,min_rate=2")
    assert isinstance(c, ErrorFeedback) and (c.inner.rank, c.inner.start, c.inner.min_rate) == (3, 5, 2.0)


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 300),
    st.data(),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), None]),
)
def test_all_finite_equals_isfinite_all(n, data, dtype, bad):
    t = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    if bad is not None:
        for i in data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3)):
            t[i] = bad
    assert all_finite(t) == bool(torch.isfinite(t).all())
    assert all_finite(t.reshape(1, -1).t()) == all_finite(t)  # non-contiguous views too
    assert all_finite(torch.zeros(0, 3, dtype=dtype))


# ---- DGC's sampled top-k threshold (LIT-056): exact selection, cheaper on big tensors ------------


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3000), st.floats(0.0005, 0.6), st.sampled_from([0.001, 0.01, 0.2, 1.0]), st.integers(0, 2**20))
def test_sampled_topk_selects_exactly_the_top_k(n, ratio, sample, seed):
    from islands.compress.topk import sampled_topk_indices

    mag = torch.rand(n, generator=torch.Generator().manual_seed(seed))
    k = max(1, min(n, int(ratio * n)))
    got = sampled_topk_indices(mag, k, sample, seed)
    assert got.numel() == k
    assert set(got.tolist()) == set(torch.topk(mag, k).indices.tolist())


def test_sampled_topk_falls_back_when_the_estimate_is_too_high(monkeypatch):
    import islands.compress.topk as topk

    monkeypatch.setattr(topk, "SAMPLE_MARGIN", 1e-3)  # threshold = the sample's maximum: too few candidates
    mag = torch.rand(100_000, generator=torch.Generator().manual_seed(5))
    got = topk.sampled_topk_indices(mag, 500, 0.001, 0)
    assert int((mag >= mag[got].min()).sum()) == 500
    assert set(got.tolist()) == set(torch.topk(mag, 500).indices.tolist())


def test_topk_sample_option_matches_plain_topk_and_keeps_global_rng():
    from islands.compress import TopK

    t = torch.randn(300, 300, generator=torch.Generator().manual_seed(4))  # above MIN_SAMPLED_NUMEL
    before = torch.get_rng_state().clone()
    plain, sampled = TopK(0.01), TopK(0.01, sample=0.01)
    for _ in range(2):
        a = plain.decompress(plain.compress(t, plain.state("w", t)))
        b = sampled.decompress(sampled.compress(t, sampled.state("w", t)))
        assert torch.equal(a, b)
    assert torch.equal(torch.get_rng_state(), before)
    assert parse_compressor("topk:ratio=0.01,sample=0.01").inner.sample == 0.01
    with pytest.raises(ValueError, match="sample"):
        parse_compressor("topk:sample=2")


# ---- wire precision: bf16 factors (rank 8 for the bytes of rank 4) and bf16 dense tensors ---------


def test_bf16_factors_halve_the_bytes_of_a_rank():
    t = torch.randn(64, 48, generator=torch.Generator().manual_seed(6))
    r4, r8 = PowerSGD(4), PowerSGD(8, bits=16)
    p4, p8 = r4.compress(t, r4.state("w", t)), r8.compress(t, r8.state("w", t))
    assert p8.nbytes == p4.nbytes == (64 + 48) * 4 * 4
    assert p8.nbytes == r8.payload_nbytes(t.shape, t.dtype)
    assert p8.tensors[0].dtype == torch.bfloat16 and r8.agree(t, r8.states["w"])[0].dtype == torch.bfloat16
    assert r8.states["w"]["Q"].dtype == torch.float32  # the warm start is kept in fp32


def test_bf16_factors_recover_a_low_rank_matrix_to_bf16_precision():
    g = torch.Generator().manual_seed(7)
    M = (
        orthonormal(torch.randn(40, 3, generator=g))
        @ torch.diag(torch.tensor([3.0, 1.0, 0.2]))
        @ orthonormal(torch.randn(30, 3, generator=g)).t()
    )
    c = PowerSGD(rank=3, bits=16)
    for _ in range(4):
        out = c.decompress(c.compress(M, c.state("w", M)))
    rel = float((out - M).norm() / M.norm())
    assert rel < 2e-2 and rel > 0  # bf16 keeps 8 bits of mantissa: close, not exact


def test_error_feedback_accounts_for_bf16_rounding():
    """Residual + what was sent == the corrected input, although the factors were rounded to bf16."""
    ef = parse_compressor("powersgd:rank=2,bits=16,dense_bits=16")
    g = torch.Generator().manual_seed(8)
    for name, shape in (("w", (20, 12)), ("b", (12,))):
        for _ in range(3):
            t = torch.randn(*shape, generator=g)
            before = ef.states[name]["residual"].clone() if name in ef.states else torch.zeros(shape)
            sent = ef.decompress(ef.compress(t, ef.state(name, t))).float()
            x = before + t
            assert torch.allclose(sent + ef.states[name]["residual"], x, atol=1e-6, rtol=0)
    assert float(ef.states["b"]["residual"].abs().max()) > 0  # the bias lost its low mantissa bits...
    assert float(ef.states["b"]["residual"].abs().max()) < 2e-2  # ...and nothing more


def test_dense_bits_narrows_only_wider_tensors():
    c = PowerSGD(4, dense_bits=16)
    b32, b16 = torch.randn(10), torch.randn(10).half()
    p32, p16 = c.compress(b32, c.state("b32", b32)), c.compress(b16, c.state("b16", b16))
    assert p32.tensors[0].dtype == torch.bfloat16 and p32.nbytes == 20 == c.payload_nbytes((10,), torch.float32)
    assert p16.tensors[0].dtype == torch.float16 and p16.nbytes == 20 == c.payload_nbytes((10,), torch.float16)
    assert c.decompress(p32).dtype == torch.float32
    assert torch.equal(c.decompress(p32), b32.to(torch.bfloat16).float())
    # the uncompressed start of a matrix travels narrowed too, and is counted so
    s = PowerSGD(2, start=1, dense_bits=16)
    w = torch.randn(12, 10)
    assert s.compress(w, s.state("w", w)).nbytes == 240 == s.payload_nbytes(w.shape, w.dtype, step=0)


def test_default_precision_is_unchanged_fp32():
    c = PowerSGD(2)
    t = torch.randn(12, 10, generator=torch.Generator().manual_seed(9))
    p = c.compress(t, c.state("w", t))
    assert p.tensors[0].dtype == torch.float32 and p.nbytes == (12 + 10) * 2 * 4
    p.tensors[0].add_(1.0)  # the payload may be reused by a caller: the warm start must not alias it
    assert not torch.equal(c.states["w"]["Q"], p.tensors[0])


@pytest.mark.parametrize("bad", ["powersgd:bits=4", "powersgd:dense_bits=8", "powersgd:bits=fp16"])
def test_bad_wire_precision_raises_clearly(bad):
    with pytest.raises(ValueError) as e:
        parse_compressor(bad)
    assert "bits" in str(e.value)


def test_int8_factors_cost_a_quarter_plus_column_scales():
    t = torch.randn(64, 48, generator=torch.Generator().manual_seed(10))
    c = PowerSGD(16, bits=8)
    payloads = _steps(c, t, 2)
    expect = (64 + 48) * 16 + 2 * 16 * 4  # codes, plus one fp32 scale per column of P and of Q
    assert (
        [p.nbytes for p in payloads]
        == [expect, expect]
        == [c.payload_nbytes(t.shape, t.dtype, step=s) for s in range(2)]
    )
    assert PowerSGD(4).payload_nbytes(t.shape, t.dtype) == (64 + 48) * 16  # the codes cost rank 4 in fp32
    codes, scale = payloads[1].tensors
    assert codes.dtype == torch.int8 and scale.shape == (16,) and int(codes.abs().max()) == 127
    assert c.sum_transport == "gather" and PowerSGD(4).sum_transport == "all_reduce"
    assert [a.dtype for a in c.agree(t, c.states["w"])] == [torch.int8, torch.float32]


def test_int8_factors_track_a_low_rank_matrix():
    g = torch.Generator().manual_seed(11)
    M = (
        orthonormal(torch.randn(40, 3, generator=g))
        @ torch.diag(torch.tensor([3.0, 1.0, 0.2]))
        @ orthonormal(torch.randn(30, 3, generator=g)).t()
    )
    c = PowerSGD(rank=3, bits=8)
    for _ in range(5):
        out = c.decompress(c.compress(M, c.state("w", M)))
    rel = float((out - M).norm() / M.norm())
    assert 0 < rel < 0.02  # 127 levels of each column's own largest entry


def test_int8_merge_decodes_each_ranks_scale_in_rank_order():
    c = PowerSGD(2, bits=8)
    g = torch.Generator().manual_seed(12)
    xs = [torch.randn(9, 2, generator=g) * s for s in (1.0, 50.0)]  # very different scales per rank
    parts = [c._encode(x) for x in xs]
    total = c.merge(parts)[0]
    assert torch.equal(total, parts[0][0].float() * parts[0][1] + parts[1][0].float() * parts[1][1])
    assert float((total - sum(xs)).abs().max()) <= sum(float(x.abs().max()) for x in xs) / 127


def test_error_feedback_keeps_int8_rounding():
    ef = parse_compressor("powersgd:rank=2,bits=8")
    g = torch.Generator().manual_seed(13)
    for _ in range(3):
        t = torch.randn(20, 12, generator=g)
        before = ef.states["w"]["residual"].clone() if "w" in ef.states else torch.zeros(20, 12)
        sent = ef.decompress(ef.compress(t, ef.state("w", t))).float()
        assert torch.allclose(sent + ef.states["w"]["residual"], before + t, atol=1e-5, rtol=0)


def test_int8_state_survives_a_checkpoint():
    t = torch.randn(16, 12, generator=torch.Generator().manual_seed(14))
    a = PowerSGD(3, bits=8)
    _steps(a, t, 2)
    b = PowerSGD(3, bits=8)
    b.load_state_dict(a.state_dict())
    pa, pb = a.compress(t, a.state("w", t)), b.compress(t, b.state("w", t))
    assert all(torch.equal(x, y) for x, y in zip(pa.tensors, pb.tensors))


def test_vectors_sent_whole_leave_no_residual_and_narrowed_ones_keep_their_rounding():
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(64, generator=g)
    ef = parse_compressor("powersgd:rank=2")
    payload = ef.compress(bias, ef.state("b", bias))
    assert ef.inner.exact(payload) and torch.equal(ef.decompress(payload), bias)
    assert torch.equal(ef.states["b"]["residual"], torch.zeros(64))
    narrow = parse_compressor("powersgd:rank=2,dense_bits=16")
    payload = narrow.compress(bias, narrow.state("b", bias))
    assert not narrow.inner.exact(payload)
    assert torch.equal(narrow.states["b"]["residual"], bias - bias.bfloat16().float())
    half = bias.bfloat16()  # a bf16 input: its fp32 error-fed sum is rounded to bf16 on the way in
    ef16 = parse_compressor("powersgd:rank=2")
    carried = torch.randn(64, generator=g) * 1e-3
    ef16.state("h", half)["residual"] = carried.clone()
    ef16.compress(half, ef16.state("h", half))
    x = half.float() + carried
    assert torch.equal(ef16.states["h"]["residual"], x - x.bfloat16().float())
