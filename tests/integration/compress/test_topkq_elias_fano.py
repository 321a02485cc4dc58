"""topkq / dct-topk with Elias-Fano coded positions (`index=elias-fano`, issue 19 goal a): the code itself, the
payload it makes (the same entries as fixed positions, fewer bytes, the analytic size), error-feedback accounting with
SparseLoCo's decayed residual, bitwise resume, bad specs, and two gloo ranks running DiLoCo with it (ranks agree
bitwise, the ledger's bytes are 4 + the analytic payload per exchange, a cut-and-resume continues bit for bit)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_outer_compress import _resume, _scenario

import islands.compress.base as base
from harness.outer import assert_train_refuses, run_world
from islands.compress import DCTTopK, ErrorFeedback, TopKQ, elias_fano as ef, parse_compressor
from islands.compress.base import Payload


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rows(n: int, k: int, rows: int, seed: int) -> torch.Tensor:
    g = _gen(seed)
    return torch.stack([torch.randperm(n, generator=g)[:k].sort().values for _ in range(rows)])


@pytest.mark.parametrize(
    "n, k",
    [
        (4096, 89),
        (4096, 41),
        (4096, 4096),
        (4096, 1),
        (1000, 10),
        (64, 40),
        (7, 7),
        (1, 1),
        (5, 2),
        (300, 150),
        (300, 151),
    ],
)
def test_elias_fano_round_trips_at_its_fixed_size(n, k):
    pos = _rows(n, k, 6, seed=n * 31 + k)
    bits = ef.encode_rows(pos, n)
    assert bits.dtype == torch.bool and bits.shape == (6, ef.nbits(n, k))
    assert torch.equal(ef.decode_rows(bits, n, k), pos)
    # the textbook bound: at most k (2 + log2(n / k)) + 1 bits, whatever the positions
    assert ef.nbits(n, k) <= k * (2 + math.log2(n / k)) + 1


def test_elias_fano_extremes_and_corruption():
    n, k = 4096, 89
    for pos in (
        torch.arange(k).view(1, k),
        torch.arange(n - k, n).view(1, k),  # packed at either end
        torch.arange(0, n, n // k)[:k].view(1, k),
    ):  # evenly spread
        assert torch.equal(ef.decode_rows(ef.encode_rows(pos, n), n, k), pos)
    assert ef.nbits(4096, 92) == 680 < 92 * 12  # the 146x setting: 7.4 bits a position against 12
    bits = ef.encode_rows(_rows(n, k, 1, seed=1), n)
    bits[0, -1] = ~bits[0, -1]  # one high bit flipped: k + 1 or k - 1 set bits
    with pytest.raises(ValueError, match="corrupt payload"):
        ef.decode_rows(bits, n, k)
    assert ef.nbits(10, 0) == 0 and ef.decode_rows(torch.zeros(3, 0, dtype=torch.bool), 10, 0).shape == (3, 0)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch-ops"])
def test_a_damaged_payload_is_named_corrupt_or_decoded_as_the_torch_path_decodes_it(monkeypatch, kernels):
    """The compiled decode (positions read from the bit stream, repacked fixed-width for the dense pass) names a
    payload whose high bits do not count k per chunk as corrupt, as the torch path does; one whose count is right
    but whose positions run past a chunk decodes as the torch path decodes it."""
    monkeypatch.setattr(base, "USE_KERNELS", kernels)
    x = torch.randn(3 * 4096 + 500, generator=_gen(7))
    c = TopKQ(0.0215, bits=2, index="elias-fano")
    p = c.compress(x, {})
    bad = p.tensors[0].clone()
    g, full, k, tail, k_tail = c.layout(x.numel())
    last = full * ef.nbits(g, k) + ef.nbits(tail, k_tail) - 1  # the tail row's last high bit: k + 1 set bits
    bad[last // 8] ^= 1 << (last % 8)
    with pytest.raises(ValueError, match="corrupt payload"):
        c.decompress(Payload([bad, *p.tensors[1:]], p.shape, p.dtype))
    # the first row's top high bit set and its highest set bit cleared: k set bits, the last past the chunk
    nb = ef.nbits(g, k)
    moved = p.tensors[0].clone()
    bits = ((moved.view(-1, 1) >> torch.arange(8, dtype=torch.uint8)) & 1).view(-1)
    high = bits[nb - (g >> ef.low_bits(g, k)) - k : nb]
    top = int(high.nonzero().max())
    for b, v in ((nb - (high.numel() - top), 0), (nb - 1, 1)):
        moved[b // 8] = (moved[b // 8] & ~(1 << (b % 8))) | (v << (b % 8))
    monkeypatch.setattr(base, "USE_KERNELS", False)
    try:
        expect = c.decompress(Payload([moved, *p.tensors[1:]], p.shape, p.dtype))
    except (IndexError, RuntimeError, ValueError) as e:
        expect = type(e)
    monkeypatch.setattr(base, "USE_KERNELS", kernels)
    try:
        got = c.decompress(Payload([moved, *p.tensors[1:]], p.shape, p.dtype))
    except (IndexError, RuntimeError, ValueError) as e:
        got = type(e)
    assert (got is expect) if isinstance(expect, type) else torch.equal(got, expect)


@pytest.mark.parametrize("n", [1, 63, 4096, 4097, 9610, 20000])
@pytest.mark.parametrize("ratio", [0.0215, 0.3, 1.0])
def test_same_entries_as_fixed_positions_in_fewer_bytes(n, ratio):
    x = torch.randn(n, generator=_gen(n))
    fixed, coded = TopKQ(ratio, bits=32), TopKQ(ratio, bits=32, index="elias-fano")
    pf, pc = fixed.compress(x, {}), coded.compress(x, {})
    assert torch.equal(fixed.decompress(pf), coded.decompress(pc))  # fp32 values: exactly the same tensor
    assert pc.nbytes == coded.payload_nbytes(x.shape, x.dtype)
    g, full, k, tail, k_tail = coded.layout(n)
    assert coded.index_nbytes(n) == -(-(full * ef.nbits(g, k) + ef.nbits(tail, k_tail)) // 8)
    if n >= 4096 and ratio < 0.5:
        assert pc.nbytes < pf.nbytes
    # 2-bit values: the same positions; against order=torch values equal up to the order of the scale's sum (fp32
    # rounding), against the default order (ascending, as Elias-Fano sends them) the same bits
    a, b = TopKQ(ratio, bits=2, order="torch"), TopKQ(ratio, bits=2, index="elias-fano")
    da, db = a.decompress(a.compress(x, {})), b.decompress(b.compress(x, {}))
    assert torch.equal(da != 0, db != 0) and torch.allclose(da, db, rtol=1e-5, atol=1e-7)
    asc = TopKQ(ratio, bits=2)
    assert torch.equal(asc.decompress(asc.compress(x, {})), db)


def test_146x_with_half_again_the_entries():
    """Issue 19's byte goal on the default LM (875,264 parameters, one exchange of the whole model, plus the 4-byte NaN
    flag of every compressed exchange): Elias-Fano positions clear 146x with up to 92 of each 4096 kept, fixed 12-bit
    positions with up to 61: half again the entries for the same bytes."""
    n = 875_264

    def cut(c):
        return 4 * n / (4 + c.payload_nbytes((n,), torch.float32))

    def most(index):
        return max(k for k in range(1, 200) if cut(TopKQ(k / 4096, bits=2, index=index)) >= 146)

    assert most("fixed") == 61 and most("elias-fano") == 92
    assert cut(DCTTopK(89 / 4096, bits=2, index="elias-fano")) >= 146  # the bench's setting, 89 of 4096 (2.17%)


@pytest.mark.parametrize(
    "spec",
    [
        "topkq:ratio=0.05,bits=2,chunk=64,index=elias-fano,decay=0.95",
        "topkq:ratio=0.05,bits=32,chunk=64,index=elias-fano",
        "dct-topk:ratio=0.05,bits=2,block=16,chunk=64,index=elias-fano,decay=0.9",
    ],
)
def test_error_feedback_accounting_with_decay(spec):
    c = parse_compressor(spec)
    assert isinstance(c, ErrorFeedback) and c.inner.index == "elias-fano"
    g = _gen(7)
    for _ in range(6):
        grad = torch.randn(500, generator=g) * torch.rand(500, generator=g) ** 3
        state = c.state("delta", grad)
        kept = c.decay * state["residual"].double()
        incoming = grad.double() + kept
        sent = c.decompress(c.compress(grad, state)).double()
        residual = c.states["delta"]["residual"].double()
        scale = sent.abs() + grad.double().abs() + kept.abs()
        assert torch.all((sent + residual - incoming).abs() <= 2**-22 * scale), spec
        if "bits=32" in spec:  # no quantisation, no transform, no decay: exact
            assert torch.equal((sent + residual).float(), incoming.float())
        assert 0 < residual.norm() < incoming.norm()


def test_state_resumes_bitwise():
    spec = "topkq:ratio=0.05,bits=2,chunk=64,index=elias-fano,decay=0.95"
    steps = [torch.randn(300, generator=_gen(20 + i)) for i in range(4)]
    run = parse_compressor(spec)
    for t in steps[:3]:
        run.compress(t, run.state("d", t))
    resumed = parse_compressor(spec)
    resumed.load_state_dict(copy.deepcopy(run.state_dict()))
    a, b = (c.compress(steps[3], c.state("d", steps[3])) for c in (run, resumed))
    assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors))
    assert torch.equal(run.states["d"]["residual"], resumed.states["d"]["residual"])
    fresh = parse_compressor(spec)
    f = fresh.compress(steps[3], fresh.state("d", steps[3]))
    assert not all(torch.equal(x, y) for x, y in zip(a.tensors, f.tensors))  # the check can fail


@pytest.mark.parametrize("spec", ["topkq:index=rice", "dct-topk:index=12"])
def test_bad_index_names_the_choices(spec):
    with pytest.raises(ValueError) as e:
        parse_compressor(spec)
    assert "fixed" in str(e.value) and "elias-fano" in str(e.value)


def test_bad_index_in_an_outer_spec_exits_2_naming_the_choices(tmp_path, capsys):
    assert_train_refuses(
        "diloco:inner_steps=5,compressor=(topkq:ratio=0.0215,index=rice)",
        ["index", "fixed", "elias-fano"],
        tmp_path,
        capsys,
    )


# ---- two gloo ranks ---------------------------------------------------------------------------------------------
EF_TOPKQ = "compressor=(topkq:ratio=0.03,bits=2,chunk=256,index=elias-fano,decay=0.95)"


def _both(world) -> dict:
    torch.manual_seed(world.rank)
    return {
        "diloco": _scenario(world, f"diloco:inner_steps=3,{EF_TOPKQ}", 7),
        "eager": _scenario(world, f"diloco:inner_steps=2,overlap=eager,{EF_TOPKQ}", 6),
        "resume": _resume(world, f"diloco:inner_steps=2,{EF_TOPKQ}", 3, 6),
    }


@pytest.fixture(scope="module")
def ranks():
    return run_world(_both, size=2, islands=2)


@pytest.mark.parametrize("name", ["diloco", "eager"])
def test_two_ranks_agree_and_ledger_is_the_analytic_payload(ranks, name):
    assert ranks[0][name]["global"].tobytes() == ranks[1][name]["global"].tobytes()
    for r in ranks:
        s = r[name]
        per_exchange = 4 + s["payload"][0]  # the NaN/Inf flag, then the payload
        assert s["exchange_sent"] and set(s["exchange_sent"]) == {per_exchange}
        assert (
            sum(s["sent"].get(k, 0) for k in ("compress_finite", "compress_gather"))
            == len(s["exchange_sent"]) * per_exchange
        )
        assert s["residual_norm"] > 0


def test_two_ranks_resume_mid_run_bitwise(ranks):
    for r in ranks:
        res = r["resume"]
        assert res["a"].tobytes() == res["b"].tobytes() and res["a_local"].tobytes() == res["b_local"].tobytes()
        assert res["a_res"].tobytes() == res["b_res"].tobytes() and abs(res["a_res"]).sum() > 0
