"""The allocation-light paths: PowerSGD's wide-form products, means decoded into given tensors, error
feedback's reused buffer. Each must give what the plain path gives."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from islands.compress import ErrorFeedback, PowerSGD, compress_and_average, parse_compressor
from islands.compress.base import Payload
from islands.compress.powersgd import times_thin
from islands.runtime.comm import Comm, CommLedger


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(1, 6), st.integers(0, 2**31))
def test_times_thin_is_the_product(n, m, r, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(n, m, generator=g), torch.randn(m, r, generator=g)
    got = times_thin(a, b)
    assert got.shape == (n, r) and got.is_contiguous()
    assert torch.allclose(got, a @ b, rtol=1e-5, atol=1e-5)
    c = torch.randn(n, r, generator=g)
    assert torch.allclose(times_thin(a.t(), c), a.t() @ c, rtol=1e-5, atol=1e-5)  # a transposed view as `a`


def _factorised_payload(seed: int) -> tuple[PowerSGD, Payload, torch.Tensor]:
    c = PowerSGD(2)
    x = torch.randn(12, 9, generator=torch.Generator().manual_seed(seed))
    return c, c.compress(x, c.state("w", x)), x


@pytest.mark.parametrize("summands", [1, 3])
def test_powersgd_mean_divides_the_factor_and_writes_into_out(summands):
    c, p, _ = _factorised_payload(0)
    p.summands = summands
    plain = c.decompress(p) / summands
    assert torch.allclose(c.decompress_mean(p), plain, rtol=1e-6, atol=1e-7)
    out = torch.full((12, 9), 5.0)
    assert c.decompress_mean(p, out) is out and torch.allclose(out, plain, rtol=1e-6, atol=1e-7)


def test_powersgd_residual_is_x_minus_sent_in_place():
    c, p, x = _factorised_payload(1)
    expect = x - c.decompress(p)
    work = x.clone()
    got = c.subtract_sent(work, p)
    assert got is work  # one pass over x, no new tensor
    assert torch.allclose(got, expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(10,), (12, 9)])
def test_a_held_payload_survives_the_next_compress(shape):
    """Error feedback reuses a buffer between steps; a payload that views it (vectors sent whole) must not."""
    ef = ErrorFeedback(PowerSGD(2))
    g = torch.Generator().manual_seed(2)
    first = ef.compress(torch.randn(shape, generator=g), ef.state("w", torch.zeros(shape)))
    kept = [t.clone() for t in first.tensors]
    ef.compress(torch.randn(shape, generator=g), ef.state("w", torch.zeros(shape)))
    assert all(torch.equal(a, b) for a, b in zip(first.tensors, kept))
    st_ = ef.states["w"]
    spare = st_.get("_spare")
    assert spare is None or spare.untyped_storage().data_ptr() != st_["residual"].untyped_storage().data_ptr()


def test_error_feedback_with_reused_buffers_matches_fresh_state_each_step():
    """Three steps with the buffers kept equal three steps where each step starts from a cloned state."""
    torch.manual_seed(0)
    grads = [torch.randn(16, 8) for _ in range(3)]
    kept = ErrorFeedback(PowerSGD(2))
    fresh = ErrorFeedback(PowerSGD(2))
    for g in grads:
        a = kept.decompress(kept.compress(g, kept.state("w", g)))
        fresh.load_state_dict(fresh.state_dict())  # drops every transient buffer
        b = fresh.decompress(fresh.compress(g, fresh.state("w", g)))
        assert torch.equal(a, b)
    assert torch.equal(kept.states["w"]["residual"], fresh.states["w"]["residual"])


@pytest.fixture
def one_rank_comm():
    from harness.procs import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield Comm(None, CommLedger())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bad", ["shape", "dtype", "names"])
def test_bad_out_is_refused_before_anything_changes(bad, one_rank_comm):
    comm = one_rank_comm
    c = parse_compressor("powersgd:rank=2")
    tensors = {"w": torch.randn(6, 5), "b": torch.randn(5)}
    out = {n: torch.empty_like(t) for n, t in tensors.items()}
    if bad == "shape":
        out["w"] = torch.empty(5, 6)
    elif bad == "dtype":
        out["b"] = torch.empty(5, dtype=torch.float64)
    else:
        out = {"b": out["b"], "w": out["w"]}
    with pytest.raises(ValueError, match="out must hold the same names"):
        compress_and_average(tensors, comm, c, out=out)
    assert c.states == {} and comm.ledger.total_sent == 0


def test_a_bucket_is_checked_in_one_pass_and_a_nan_is_still_named(one_rank_comm):
    from islands.compress.average import _tiling

    bucket = torch.randn(6 * 5 + 5 + 4)
    named = {"w": bucket[:30].view(6, 5), "b": bucket[30:35], "c": bucket[35:]}
    flat = _tiling(list(named.values()))
    assert flat is not None and flat.data_ptr() == bucket.data_ptr() and flat.numel() == bucket.numel()
    assert _tiling([bucket[:30], bucket[31:]]) is None  # a gap: entries that are nobody's
    assert _tiling([bucket[:30], bucket[20:]]) is None  # an overlap
    assert _tiling([bucket[:30], torch.randn(9)]) is None  # two storages
    named["c"][2] = float("inf")
    with pytest.raises(ValueError, match="'c' has 1 NaN/Inf"):
        compress_and_average(named, one_rank_comm, parse_compressor("powersgd:rank=2"), out=named)


@pytest.mark.parametrize("into", [False, True])
def test_an_overflowing_mean_is_named_with_or_without_out(into, one_rank_comm):
    """Finite inputs whose PowerSGD factors overflow fp32 (P = M Q near 3e38): the decoded mean is not
    finite, and the error names the tensor, whether the mean went into a bucket or a new tensor."""
    bucket = torch.cat([torch.ones(5), torch.full((16,), 3e38)])
    named = {"ok": bucket[:5], "big": bucket[5:].view(8, 2)}
    with pytest.raises(ValueError, match=r"averaged result of 'big' has \d+ NaN/Inf"):
        compress_and_average(
            named, one_rank_comm, parse_compressor("powersgd:rank=1,ef=0"), out=named if into else None
        )
