"""Pieces of the outer strategies without a process group: quantiser, fragments, outer steps, schedule."""

from __future__ import annotations

import copy

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from islands.runtime.world import LoneComm, World
from islands.sync.outer import make_outer
from islands.sync.outer.diloco import DiLoCo
from islands.sync.outer.flat import FlatView, fragment_bounds
from islands.sync.outer.outer_opt import OuterSGD, PrimalAveraging
from islands.sync.outer.quant4 import Quant4
from islands.sync.outer.zstd4 import Quant4Zstd


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), block=st.integers(1, 64), scale=st.floats(1e-6, 1e3), seed=st.integers(0, 10**6))
def test_quant4_round_trip_within_stated_bound(n, block, scale, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    q = Quant4(block)
    payload = q.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == q.payload_nbytes(n)
    err = (q.decode(payload, n) - x).abs()
    bound = q.bound(x)
    # s/14 per value, plus fp32 rounding of a few ulp of the block scale
    assert bool((err <= bound * (1 + 1e-5) + 1e-6 * bound * 14).all()), float((err - bound).max())


def test_quant4_bound_is_tight_and_zeros_are_exact():
    q = Quant4(4)
    x = torch.tensor([1.0, 1.0 / 14, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0, 3.0 / 14])
    y = q.decode(q.encode(x), x.numel())
    assert y[4:8].eq(0).all() and y[0] == 1 and y[3] == -1  # zero block exact, block maxima exact
    assert (y - x).abs().max() <= 1.0 / 14 + 1e-7
    with pytest.raises(ValueError, match="NaN/Inf"):
        q.encode(torch.tensor([float("nan")]))
    with pytest.raises(ValueError, match="does not hold"):
        q.decode(torch.zeros(3, dtype=torch.uint8), 9)


@settings(max_examples=30, deadline=None)
@given(numel=st.integers(1, 500), fragments=st.integers(1, 20))
def test_fragments_cover_every_element_exactly_once(numel, fragments):
    if fragments > numel:
        with pytest.raises(ValueError, match="fragments must be in"):
            fragment_bounds(numel, fragments)
        return
    bounds = fragment_bounds(numel, fragments)
    seen = torch.zeros(numel, dtype=torch.int64)
    for lo, hi in bounds:
        seen[lo:hi] += 1
    assert seen.eq(1).all()
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("h, f", [(4, 2), (10, 4), (7, 7), (100, 4), (5, 1)])
def test_each_fragment_starts_exactly_once_per_cycle(h, f):
    s = DiLoCo.from_options(inner_steps=h, fragments=f)
    for cycle in range(3):
        starts = [p for done in range(cycle * h + 1, (cycle + 1) * h + 1) for p in s.schedule.starting(done)]
        assert sorted(starts) == list(range(f)), (cycle, starts)
        per_step = [len(s.schedule.starting(d)) for d in range(cycle * h + 1, (cycle + 1) * h + 1)]
        assert max(per_step) == 1  # staggered: at most one fragment's exchange starts at a time


def test_flat_view_reads_and_writes_across_tensor_boundaries():
    a, b = torch.arange(6.0).reshape(2, 3), torch.arange(6.0, 10.0)
    v = FlatView([a, b])
    assert v.read(4, 8).tolist() == [4.0, 5.0, 6.0, 7.0]
    v.write(torch.tensor([-1.0, -2.0, -3.0]), lo=5)
    assert a.reshape(-1)[5] == -1 and b[:2].tolist() == [-2.0, -3.0]
    assert v.read().numel() == 10


def test_outer_steps():
    p, d = torch.ones(4), torch.full((4,), 0.5)
    OuterSGD(1.0).step(p, d)
    assert p.tolist() == [0.5] * 4  # lr 1, no momentum: lands on global - delta
    p, opt = torch.ones(4), OuterSGD(0.7, momentum=0.9, nesterov=True)
    opt.step(p, d[:2], 0, 2)  # first step: buf = d; update = d + 0.9 d
    assert torch.allclose(p, torch.tensor([1 - 0.7 * 1.9 * 0.5] * 2 + [1.0, 1.0]))
    assert opt.buf[2:].eq(0).all()  # a fragment's step touches only its own momentum
    p, pa = torch.ones(2), PrimalAveraging(1.0, weight=0.25)
    pa.step(p, torch.ones(2))  # z = 0, global = 0.75 * 1 + 0.25 * 0
    assert p.tolist() == [0.75, 0.75] and pa.z.tolist() == [0.0, 0.0]


def _one_island(spec: str, steps: int, cut: int | None = None):
    """Train a tiny MLP alone (LoneComm); optionally checkpoint at `cut` and resume into fresh objects."""
    from islands.models import MLP

    def fresh():
        torch.manual_seed(0)
        model = MLP(8, 16, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        s = make_outer(spec)
        s.wrap(model, opt, World.single())
        return model, opt, s

    def step(model, opt, s, i):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        s.after_step(model, opt, i)

    model, opt, s = fresh()
    snap = None
    for i in range(steps):
        if i == cut:
            snap = copy.deepcopy((model.state_dict(), opt.state_dict(), s.state_dict()))
        step(model, opt, s, i)
    s.finish(model)  # the final synchronisation after the last step
    if snap is None:
        return s, None
    m2, o2, s2 = fresh()
    m2.load_state_dict(snap[0])
    o2.load_state_dict(snap[1])
    s2.load_state_dict(snap[2])
    for i in range(cut, steps):
        step(m2, o2, s2, i)
    s2.finish(m2)
    return s, s2


# LIT-212's outer step (PAPER) where the point is that the outer momentum buffer comes back too
PAPER = "outer=nesterov,outer_lr=0.7,momentum=0.9"


@pytest.mark.parametrize(
    "spec",
    [
        "diloco:inner_steps=3",
        f"diloco:inner_steps=3,{PAPER}",
        "diloco:inner_steps=3,outer=primal",
        f"streaming-diloco:inner_steps=4,fragments=2,block=8,{PAPER}",
        "slowmo:every=2",
        "easgd:every=2",
        "overlap-local-sgd:tau=2",
    ],
)
def test_single_island_resume_gives_identical_next_sync(spec):
    a, b = _one_island(spec, steps=10, cut=4)
    assert torch.equal(a.global_flat, b.global_flat)
    assert torch.equal(a.local.read(), b.local.read())


def test_eval_model_is_the_last_synchronised_global_model():
    s, _ = _one_island("diloco:inner_steps=4", steps=6)
    g = torch.cat([p.reshape(-1) for p in s.eval_model(None).parameters()])
    assert torch.equal(g, s.global_flat)
    assert s.rounds == 2  # after 4 steps, and the shortened final round at 6


def test_outer_momentum_state_round_trips():
    s, _ = _one_island(f"diloco:inner_steps=2,{PAPER}", steps=4)
    state = copy.deepcopy(s.state_dict())
    t = make_outer(f"diloco:inner_steps=2,{PAPER}")
    from islands.models import MLP

    torch.manual_seed(0)
    m = MLP(8, 16, 3)
    t.wrap(m, torch.optim.AdamW(m.parameters()), World.single())
    t.load_state_dict(state)
    assert torch.equal(t.outer.opt.buf, s.outer.opt.buf) and torch.equal(t.global_flat, s.global_flat)
    with pytest.raises(ValueError, match="another model"):
        t.load_state_dict({**state, "global": torch.zeros(3), "local": torch.zeros(3)})


def test_zstd_stage_decodes_exactly_what_quant4_decodes_and_beats_4_bits_on_bell_shaped_deltas():
    torch.manual_seed(0)
    x = torch.randn(50_001) * 1e-3
    z, q = Quant4Zstd(1024), Quant4(1024)
    payload = z.encode(x)
    assert torch.equal(z.decode(payload, x.numel()), q.decode(q.encode(x), x.numel()))
    assert payload.numel() < 0.45 * x.numel()  # < 3.6 bits per value; plain 4-bit is 4 bits + scales
    assert payload.numel() < q.payload_nbytes(x.numel())
    with pytest.raises(ValueError, match="not a zstd frame"):
        z.decode(torch.zeros(10, dtype=torch.uint8), x.numel())


class _SameDeltaComm(LoneComm):
    """Four islands that all send this rank's vector: the all-reduce sum is 4x it, the mean is it (the rest of the
    Comm contract, runtime.contracts.Collectives, as a lone Comm has it)."""

    size, rank = 4, 0

    def all_reduce(self, tensor, op=None, kind="all_reduce"):
        return tensor.mul_(4)


def test_lr_scale_sqrt_islands_multiplies_the_outer_step_by_sqrt_m():
    from islands.models import MLP

    steps = {}
    for scale in ("none", "sqrt-islands"):
        torch.manual_seed(0)
        model = MLP(8, 16, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s = make_outer(f"diloco:inner_steps=1,outer=sgd,outer_lr=1,momentum=0,lr_scale={scale}")
        s.wrap(model, opt, World.single())
        s.comm = _SameDeltaComm()
        start = s.global_flat.clone()
        x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        s.after_step(model, opt, 0)
        steps[scale] = s.global_flat - start
    assert torch.allclose(steps["sqrt-islands"], 2.0 * steps["none"], atol=1e-7)  # sqrt(4) = 2
    assert steps["none"].abs().max() > 0
    with pytest.raises(ValueError, match="lr_scale"):
        make_outer("diloco:lr_scale=linear")


class _TwoIslandComm(_SameDeltaComm):
    size = 2

    def all_reduce(self, tensor, op=None, kind="all_reduce"):
        return tensor.mul_(2)


def _one_outer_step(spec: str, comm) -> torch.Tensor:
    from islands.models import MLP

    torch.manual_seed(0)
    model = MLP(8, 16, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = make_outer(spec)
    s.wrap(model, opt, World.single())
    s.comm = comm
    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    s.after_step(model, opt, 0)
    return s.global_flat.clone()


def test_default_outer_step_is_the_measured_sqrt_islands_step_on_two_islands_bitwise():
    """The default (plain SGD, lr sqrt(2)) is, on 2 islands, bit for bit the step diloco-vs-ddp measured
    (outer_lr=1, lr_scale=sqrt-islands); on 4 islands it stays at sqrt(2), where sqrt-islands takes 2."""
    measured = "diloco:inner_steps=1,outer=sgd,outer_lr=1,momentum=0,lr_scale=sqrt-islands"
    default = _one_outer_step("diloco:inner_steps=1", _TwoIslandComm())
    assert torch.equal(default, _one_outer_step(measured, _TwoIslandComm()))
    assert torch.equal(_one_outer_step("diloco:inner_steps=1", _SameDeltaComm()), default)  # no growth with M
    assert not torch.equal(_one_outer_step(measured, _SameDeltaComm()), default)


def test_replay_landing_is_new_global_plus_the_steps_since_the_send():
    """One island, F=1, tau=1: after landing, local = new global + (local now - local at send)."""
    from islands.models import MLP

    torch.manual_seed(0)
    model = MLP(8, 16, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = make_outer("streaming-diloco:inner_steps=2,fragments=1,tau=1,bits=32,landing=replay")
    s.wrap(model, opt, World.single())
    seen = {}
    for i in range(3):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(i))
        torch.nn.functional.cross_entropy(model(x), torch.arange(8) % 3).backward()
        opt.step()
        opt.zero_grad()
        before = s.local.read()
        s.after_step(model, opt, i)
        seen[i] = before
        if i == 1:
            at_send = s.schedule.at_send[0].clone()
            assert torch.equal(at_send, before)  # the send after step 2 keeps the local fragment it left with
    # landing after step 3: local = global + (local before landing - local at send)
    assert torch.allclose(s.local.read(), s.global_flat + (seen[2] - at_send), atol=1e-7)
    assert not s.schedule.at_send
