"""int8/int4's compiled path (kernels_quant) gives what torch gives: the uniforms are torch.rand's, drawn from the
torch.Generator's own MT19937 inside the rounding pass, and the generator's state after a call is the state torch.rand
leaves, so the wire bytes, the decoded tensors, error feedback's residuals and a checkpointed generator are bit for bit
those of the torch ops (USE_KERNELS off), including the NaN fallback, empty vectors and tails that are not a multiple
of the pass's chunk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import islands.compress.base as base
import islands.compress.kernels_quant as kq
from islands.compress import Agreed, parse_compressor
from islands.compress.quantize import SharedScaleQuant, _quant_kernels

CHUNK = kq.CHUNK
SIZES = [0, 1, 2, 3, 623, 624, 625, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3, 5 * CHUNK + 624 * 3 + 1]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a, b)


def _draw(gen: torch.Generator, n: int) -> np.ndarray:
    state = kq.engine(gen)
    assert state is not None
    raw, words, pos = state
    u = np.empty(n, np.float32)
    kq.store(gen, raw, words, kq.uniforms(words, pos, u))
    return u


def test_this_torch_generator_is_the_one_replayed():
    assert kq.matches_torch()


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3])
def test_uniforms_and_the_state_after_are_torch_rands(seed):
    ours, ref = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    for n in [0, 1, 622, 1, 624, 625, 0, 3 * 624, 5000, 17]:  # block boundaries from every side
        u = _draw(ours, n)
        want = torch.rand(n, generator=ref).numpy()
        assert np.array_equal(u.view(np.uint32), want.view(np.uint32)), n
        assert torch.equal(ours.get_state(), ref.get_state()), n
    assert u.min() >= 0.0 and u.max() < 1.0


def test_nothing_drawn_leaves_a_fresh_generator_byte_for_byte():
    gen = torch.Generator().manual_seed(3)
    before = gen.get_state().clone()
    assert _draw(gen, 0).size == 0
    assert torch.equal(gen.get_state(), before)


@pytest.mark.parametrize("bits", [8, 4])
def test_decode_keeps_its_compiled_pass_where_the_replay_is_declined(monkeypatch, bits):
    """Another torch's generator (matches_torch False): the wire comes from torch.rand, and decode and subtract_sent,
    which draw nothing, still run compiled; the same bits as the torch ops throughout."""
    x = _inputs(CHUNK + 5)
    xs = [x, _inputs(77)]
    slow = _rounds(bits, False, monkeypatch, xs)
    monkeypatch.setattr(base, "USE_KERNELS", True)
    monkeypatch.setattr(kq, "matches_torch", lambda: False)
    assert _quant_kernels(x, draws=True) is None and _quant_kernels(x) is kq
    c = SharedScaleQuant(bits, seed=11)
    for x_, (wire, one, two, gen_state) in zip(xs, slow):
        st = c.state(f"v{x_.numel()}", x_)
        p = c.compress(x_, st, Agreed(c.agree(x_, st), 1))
        assert _same(p.tensors[0], wire) and _same(c.decompress(p), one)
        assert torch.equal(c.generator(x_.device).get_state(), gen_state)
        work = x_.clone()
        assert c.subtract_sent(work, p) is work and _same(work, x_ - one)
        p.summands = 2
        assert _same(c.decompress(p), two)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_state_torch_never_leaves_is_drawn_by_torch(monkeypatch, bits):
    """A generator whose `next` disagrees with `left` (set by hand): the replay declines it and torch.rand draws."""
    x = _inputs(CHUNK + 9)
    wires = []
    for kernels in (True, False):
        monkeypatch.setattr(base, "USE_KERNELS", kernels)
        c = SharedScaleQuant(bits, seed=4)
        gen = c.generator(x.device)
        torch.rand(10, generator=gen)  # left 615, next 10
        raw = gen.get_state().clone()
        raw[16:24] = torch.tensor([3], dtype=torch.int64).view(torch.uint8)  # next 3: torch reads word 3 next
        gen.set_state(raw)
        assert kq.engine(gen) is None
        wires.append((c.compress(x, c.state("w", x)).tensors[0], gen.get_state()))
    assert _same(wires[0][0], wires[1][0]) and torch.equal(wires[0][1], wires[1][1])


def _rounds(bits: int, kernels: bool, monkeypatch, xs: list[torch.Tensor], parties: int = 1, scale=None):
    """Each x compressed and decoded in turn by one compressor: (wires, decoded, decoded as a sum of 2, generator
    states)."""
    monkeypatch.setattr(base, "USE_KERNELS", kernels)
    assert (_quant_kernels(torch.zeros(1), draws=True) is kq) == kernels  # the compiled path runs (self-check passed)
    c = SharedScaleQuant(bits, seed=11)
    out: list[tuple] = []
    for x in xs:
        st = c.state(f"v{x.numel()}", x)
        agreed = Agreed(c.agree(x, st) if scale is None else [scale], parties)
        p = c.compress(x, st, agreed)
        one = c.decompress(p)
        p.summands = 2
        out.append((p.tensors[0], one, c.decompress(p), c.generator(x.device).get_state().clone()))
    return out


def _inputs(n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("parties", [1, 3])
def test_compress_and_decode_are_the_torch_ops(monkeypatch, bits, parties):
    xs = [_inputs(n) for n in SIZES]
    fast = _rounds(bits, True, monkeypatch, xs, parties)
    slow = _rounds(bits, False, monkeypatch, xs, parties)
    for n, a, b in zip(SIZES, fast, slow):
        assert all(_same(p, q) for p, q in zip(a, b)), n


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("where", [0, 5, CHUNK - 1, CHUNK, 2 * CHUNK + 2])
def test_a_nan_takes_torchs_ops_on_the_same_uniforms(monkeypatch, bits, where):
    n = 3 * CHUNK + 5
    x = _inputs(n)
    x[where] = float("nan")
    xs = [_inputs(999), x, _inputs(CHUNK + 1)]  # the round after a NaN draws from where torch.rand left off
    scale = torch.tensor([9.0])  # another rank's finite max
    fast = _rounds(bits, True, monkeypatch, xs, scale=scale)
    slow = _rounds(bits, False, monkeypatch, xs, scale=scale)
    for a, b in zip(fast, slow):
        assert all(_same(p, q) for p, q in zip(a, b))


@pytest.mark.parametrize("bits", [8, 4])
def test_inf_values_and_odd_scales_are_the_torch_ops(monkeypatch, bits):
    x = _inputs(CHUNK + 7)
    x[3], x[CHUNK + 2] = float("inf"), float("-inf")
    for scale in (
        torch.tensor([2.0]),
        torch.tensor([float("inf")]),
        torch.tensor([float("nan")]),
        torch.tensor([1e-30]),
    ):
        fast = _rounds(bits, True, monkeypatch, [x, _inputs(50)], scale=scale)
        slow = _rounds(bits, False, monkeypatch, [x, _inputs(50)], scale=scale)
        for a, b in zip(fast, slow):
            assert all(_same(p, q) for p, q in zip(a, b)), scale


@pytest.mark.parametrize("spec", ["int8:ef=1", "int4:ef=1"])
def test_error_feedback_residuals_are_the_torch_ops(monkeypatch, spec):
    n = 2 * CHUNK + 11
    runs = []
    for kernels in (True, False):
        monkeypatch.setattr(base, "USE_KERNELS", kernels)
        ef = parse_compressor(spec)
        st = ef.state("w", torch.zeros(n))
        seen = []
        for r in range(4):
            g = _inputs(n + r)[:n]
            p = ef.compress(g, st, Agreed(ef.agree(g, st), 1))
            seen.append((p.tensors[0], st["residual"].clone()))
        runs.append(seen)
    for (wa, ra), (wb, rb) in zip(*runs):
        assert _same(wa, wb) and _same(ra, rb)


@pytest.mark.parametrize("bits", [8, 4])
def test_subtract_sent_in_place_is_x_minus_the_decode(bits):
    c = SharedScaleQuant(bits, seed=2)
    x = _inputs(CHUNK + 3)
    p = c.compress(x, c.state("w", x))
    want = x - c.decompress(p)
    work = x.clone()
    got = c.subtract_sent(work, p)
    assert got is work and _same(got, want)
    half = x.to(torch.bfloat16)  # decompress rounds to bf16: torch's ops, a new tensor
    p = c.compress(half, c.state("h", half))
    x32 = half.float()
    got = c.subtract_sent(x32.clone(), p)
    assert _same(got, x32 - c.decompress(p).float())


@pytest.mark.parametrize("bits", [8, 4])
def test_a_checkpointed_generator_resumes_either_path(monkeypatch, bits):
    x = _inputs(3 * CHUNK + 1)
    monkeypatch.setattr(base, "USE_KERNELS", True)
    a = SharedScaleQuant(bits, seed=5)
    a.compress(x, a.state("w", x))
    saved = a.state_dict()
    wires = []
    for kernels in (True, False):
        monkeypatch.setattr(base, "USE_KERNELS", kernels)
        b = SharedScaleQuant(bits, seed=0)
        b.load_state_dict(saved)
        wires.append(b.compress(x, b.state("w", x)).tensors[0])
    monkeypatch.setattr(base, "USE_KERNELS", True)
    going_on = a.compress(x, a.state("w", x)).tensors[0]  # the run that was never interrupted
    assert _same(wires[0], going_on) and _same(wires[1], going_on)


def test_rounding_stays_unbiased_on_the_compiled_path():
    t = torch.linspace(-2, 3, 40)
    for c, draws, tol in ((SharedScaleQuant(4, seed=2), 2000, 0.05), (SharedScaleQuant(8, seed=3), 1000, 0.01)):
        st = c.state("w", t)
        mean = sum(c.decompress(c.compress(t, st)) for _ in range(draws)) / draws
        assert float((mean - t).abs().max()) < tol * float(t.abs().max()), c
