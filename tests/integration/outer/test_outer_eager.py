"""DiLoCo's overlap=delayed|eager (islands.sync.outer.eager): the exchange of a round overlaps the next round.

Checked: the delayed step with zero delay is plain DiLoCo bit for bit (F=1 and F=2, default and Nesterov outer steps);
overlap=none is untouched (test_outer_dist's scenarios); both ranks end with the same global model; finish lands
everything; the exchange is not waited on before the next boundary; bytes once per round; a resume cut with an
exchange in flight continues bitwise; the update formulas alone (one island); bad specs exit 2 naming the choices.
"""

from __future__ import annotations

import copy
import itertools
import math
import re

import numpy as np
import pytest
import torch
from test_outer_dist import Run, cut_and_resume

from harness.outer import assert_train_refuses, run_world

PAPER = "outer=nesterov,outer_lr=0.7,momentum=0.9"
# name -> (spec, steps, delay override or None)
SCENARIOS = {
    "plain": ("diloco:inner_steps=3", 7, None),
    "delayed-d0": ("diloco:inner_steps=3,overlap=delayed", 7, 0),
    "plain-paper": (f"diloco:inner_steps=3,{PAPER}", 7, None),
    "eager-d0-paper": (f"diloco:inner_steps=3,overlap=eager,{PAPER}", 7, 0),
    "plain-f2": ("streaming-diloco:inner_steps=4,fragments=2,tau=0,bits=32", 9, None),
    "delayed-f2-d0": ("streaming-diloco:inner_steps=4,fragments=2,bits=32,overlap=delayed", 9, 0),
    "delayed": ("diloco:inner_steps=3,overlap=delayed", 7, None),
    "eager": ("diloco:inner_steps=3,overlap=eager", 7, None),
    "eager-boundary-end": ("diloco:inner_steps=3,overlap=eager", 6, None),
    "eager-f2-4bit": ("streaming-diloco:inner_steps=4,fragments=2,bits=4,block=16,overlap=eager", 9, None),
    "eager-topkq": ("diloco:inner_steps=3,overlap=eager,compressor=(topkq:ratio=0.1,bits=4)", 7, None),
}
RESUMES = {  # cut after step 4: the exchange of the round ending at step 3 is in flight
    "delayed": (f"diloco:inner_steps=3,overlap=delayed,{PAPER}", 4, 8),
    "eager": (f"diloco:inner_steps=3,overlap=eager,{PAPER}", 4, 8),
    "eager-f2": ("streaming-diloco:inner_steps=4,fragments=2,bits=32,overlap=eager", 5, 9),
    "eager-topkq": ("diloco:inner_steps=3,overlap=eager,compressor=(topkq:ratio=0.1,bits=4)", 4, 8),
}


def _run(world, spec: str, delay) -> Run:
    run = Run(world, spec)
    if delay is not None:
        run.strategy.schedule.delay = delay
    return run


def _scenario(world, spec: str, steps: int, delay) -> dict:
    before = world.ledger.snapshot()
    run = _run(world, spec, delay)
    s = run.strategy
    unwaited = []  # per step: no exchange in flight has been waited on (only boundaries wait, one round later)
    for i in range(steps):
        run.step(i)
        unwaited.append(all(p._value is None for _, _, p in s.schedule.pending))
    in_flight = [(p, lands) for p, lands, _ in s.schedule.pending]
    run.finish()
    after = world.ledger.snapshot()
    sent = {k: after["sent"].get(k, 0) - before["sent"].get(k, 0) for k in after["sent"]}
    # wrap's agreement on the start: an 8-byte digest, nothing more, as every rank seeds alike here
    assert sent.pop("outer_init", 0) == 8, sent
    return {
        "global": run.global_np(),
        "local": run.local_np(),
        "sent": {k: v for k, v in sent.items() if v},
        "rounds": s.rounds,
        "sends": list(s.schedule.sends),
        "numel": s.global_flat.numel(),
        "unwaited": unwaited,
        "in_flight": in_flight,
        "pending_after": len(s.schedule.pending),
        "exchanges": len(s.exchange.sent),
    }


def _resume(world, spec: str, cut: int, steps: int) -> dict:
    seen = {}
    a, b = cut_and_resume(
        world, spec, cut, steps, at_cut=lambda run: seen.update(in_flight=len(run.strategy.schedule.pending))
    )
    in_flight = seen["in_flight"]
    return {
        "a": a.global_np(),
        "b": b.global_np(),
        "a_local": a.local_np(),
        "b_local": b.local_np(),
        "in_flight": in_flight,
    }


def _all(world) -> dict:
    torch.manual_seed(world.rank)
    out = {name: _scenario(world, *args) for name, args in SCENARIOS.items()}
    out["resume"] = {name: _resume(world, *args) for name, args in RESUMES.items()}
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_world(_all, size=2, islands=2)


@pytest.mark.parametrize(
    "plain, delayed", [("plain", "delayed-d0"), ("plain-paper", "eager-d0-paper"), ("plain-f2", "delayed-f2-d0")]
)
def test_delayed_step_with_zero_delay_is_plain_diloco_bitwise(ranks, plain, delayed):
    for r in ranks:
        assert r[plain]["global"].tobytes() == r[delayed]["global"].tobytes()
        assert r[plain]["local"].tobytes() == r[delayed]["local"].tobytes()
        assert r[plain]["sent"] == r[delayed]["sent"]


@pytest.mark.parametrize("name", ["delayed", "eager", "eager-boundary-end", "eager-f2-4bit", "eager-topkq"])
def test_ranks_end_with_the_same_global_model_holding_all_work(ranks, name):
    a, b = ranks[0][name], ranks[1][name]
    assert a["global"].tobytes() == b["global"].tobytes()
    for r in ranks:  # finish landed everything and every island adopted the global model
        assert r[name]["pending_after"] == 0
        assert r[name]["local"].tobytes() == r[name]["global"].tobytes()
        assert np.isfinite(r[name]["global"]).all()
    assert np.abs(a["global"] - ranks[0]["plain"]["global"]).max() > 0  # it did train differently from plain


def test_overlapped_exchange_is_not_waited_on_before_the_next_boundary(ranks):
    for r in ranks:
        for name in ("delayed", "eager", "eager-f2-4bit"):
            assert all(r[name]["unwaited"]), name
        # after 7 steps with H=3: the round that ended at step 6 is still in flight, landing at step 9
        assert r["delayed"]["in_flight"] == [(0, 9)]
        assert r["eager-f2-4bit"]["in_flight"] == [(0, 10), (1, 12)]


def test_bytes_once_per_round(ranks):
    for r in ranks:
        n4 = 4 * r["plain"]["numel"]
        # boundaries at 3 and 6, then the final sync of the work of step 7: three exchanges, as plain DiLoCo
        for name in ("delayed", "eager"):
            assert r[name]["sends"] == [3] and r[name]["sent"] == {"outer_delta": 3 * n4}, name
            assert r[name]["rounds"] == 3
        # the run ended on a boundary: its exchange lands in finish, and no empty exchange follows
        assert r["eager-boundary-end"]["sent"] == {"outer_delta": 2 * n4}
        assert r["eager-topkq"]["exchanges"] == 3 and 0 < sum(r["eager-topkq"]["sent"].values()) < 3 * n4


@pytest.mark.parametrize("name", sorted(RESUMES))
def test_resume_with_an_exchange_in_flight_is_bitwise(ranks, name):
    for r in ranks:
        res = r["resume"][name]
        assert res["in_flight"] >= 1
        assert res["a"].tobytes() == res["b"].tobytes()
        assert res["a_local"].tobytes() == res["b_local"].tobytes()


# ---- one island (LoneComm): the update formulas -----------------------------------------------------------------


def _lone(spec: str, steps: int):
    from islands.models import MLP
    from islands.runtime.world import World
    from islands.sync.outer import make_outer

    torch.manual_seed(0)
    model = MLP(8, 16, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = make_outer(spec)
    s.wrap(model, opt, World.single())
    trace = []
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        trace.append((s.global_flat.clone(), s.local.read()))  # before after_step
        s.after_step(model, opt, i)
        trace.append((s.global_flat.clone(), s.local.read()))  # after
    return s, trace


def test_update_formulas_on_one_island():
    lr = math.sqrt(2)  # the default outer step: plain SGD, lr sqrt(2)
    _, d = _lone("diloco:inner_steps=2,overlap=delayed", 4)
    _, e = _lone("diloco:inner_steps=2,overlap=eager", 4)
    g0, x2 = d[2][0], d[2][1]  # global before the first boundary (after step 2), local there
    # first boundary: nothing landed; delayed keeps the island's own work, eager steps it with its own delta
    assert torch.equal(d[3][0], g0) and torch.allclose(d[3][1], x2, atol=1e-6)
    start_e = e[3][1]
    assert torch.allclose(start_e, g0 - lr * (g0 - e[2][1]), atol=1e-6)
    # second boundary: the first round's mean (M=1: own delta) lands on the global model
    assert torch.allclose(d[7][0], g0 - lr * (g0 - x2), atol=1e-6)
    assert torch.allclose(e[7][0], g0 - lr * (g0 - e[2][1]), atol=1e-6)
    fresh_d, fresh_e = d[3][1] - d[6][1], start_e - e[6][1]  # the second round's own work
    assert torch.allclose(d[7][1], d[7][0] - fresh_d, atol=1e-6)
    assert torch.allclose(e[7][1], e[7][0] - lr * fresh_e, atol=1e-6)


def test_eager_trial_step_leaves_the_outer_state_alone():
    s, _ = _lone(f"diloco:inner_steps=2,overlap=eager,{PAPER}", 5)
    before = s.outer.opt.state_dict()["momentum_buffer"].clone()
    assert before.abs().max() > 0  # a momentum buffer that a full trial step would carry forward
    d = torch.full((s.global_flat.numel(),), 1e-3)
    stand_in = s.schedule._trial(0, d)
    assert torch.equal(s.outer.opt.state_dict()["momentum_buffer"], before)
    # the stand-in is the step d's share: -lr (1 + momentum) d for Nesterov, the carried momentum cancelling
    assert torch.allclose(stand_in, s.global_flat - 0.7 * 1.9 * d, atol=1e-6)


def test_overlap_none_is_the_default_and_a_plain_round_waits():
    s, _ = _lone("diloco:inner_steps=2", 4)
    assert s.schedule.options()["overlap"] == "none" and not s.schedule.pending and s.synced_at == 4


# ---- specs -------------------------------------------------------------------------------------------------------


def test_spec_strings_resolve():
    from islands.sync.outer.spec import parse_outer

    assert parse_outer("diloco:inner_steps=50,overlap=eager")["overlap"] == "eager"
    assert parse_outer("diloco:inner_steps=50")["overlap"] == "none"
    s = parse_outer("streaming-diloco:inner_steps=8,fragments=2,bits=32,overlap=delayed,compressor=(topkq)")
    assert s["overlap"] == "delayed"


@pytest.mark.parametrize(
    "outer, words",
    [
        ("diloco:inner_steps=5,overlap=sometimes", ["overlap must be one of none, delayed, eager", "'sometimes'"]),
        ("streaming-diloco:inner_steps=8,fragments=2,tau=2,overlap=eager", ["whole round later", "tau"]),
        ("diloco:inner_steps=5,overlap=delayed,sync_inner_state=1", ["sync_inner_state needs overlap=none"]),
    ],
)
def test_bad_overlap_specs_exit_2_naming_the_choices(outer, words, tmp_path, capsys):
    assert_train_refuses(outer, words, tmp_path, capsys)


# ---- floating buffers (BatchNorm) with fragments in flight ---------------------------------------------------------

BN_SPEC = "streaming-diloco:inner_steps=4,fragments=2,bits=32,overlap=eager"  # cycles end at steps 4 and 8
# adaptive rounds behind the overlap (adaptive.py): equal speeds (a deterministic clock: measured ones made CI's
# islands unequal and their last rounds unpaired), so rounds of 4 on both islands, ending at 4 and 8
BN_ADAPT_SPEC = "diloco:inner_steps=4,overlap=eager,adapt=speed"


class _BNRun:
    """A BatchNorm model under BN_SPEC, stepped by hand in the trainer's hook order."""

    def __init__(self, world, spec: str = BN_SPEC):
        from islands.sync.outer import make_outer

        torch.manual_seed(0)
        self.world, self.spec = world, spec
        self.model = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.strategy = make_outer(spec)
        self.strategy.wrap(self.model, self.opt, world)
        if "adapt=" in spec:  # a clock of its own (each reading half a second on): equal speeds whatever the load
            ticks = itertools.count()
            self.strategy.schedule.meter.timer = self.strategy.schedule.meter.wallclock = lambda: (
                float(next(ticks)) * 0.5
            )

    def step(self, i: int) -> None:
        g = torch.Generator().manual_seed(1000 * self.world.rank + i)
        x = torch.randn(16, 6, generator=g) * (1 + self.world.rank)  # the islands' statistics differ
        y = torch.randint(0, 3, (16,), generator=g)
        self.strategy.on_batch(x, i)
        torch.nn.functional.cross_entropy(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.strategy.after_step(self.model, self.opt, i)

    def floating(self, which: str) -> np.ndarray:
        bufs = self.strategy.local_buffers if which == "local" else self.strategy.global_buffers
        return torch.cat([b.reshape(-1) for b in bufs if b.is_floating_point()]).numpy().copy()


def _bn(world, spec: str = BN_SPEC) -> dict:
    run = _BNRun(world, spec)
    s = run.strategy
    waited = []
    run_in_order = s.exchange.run
    s.exchange.run = lambda fn: waited.append(run.strategy.clock) or run_in_order(fn)  # in_order: waits on the pool
    local_at, global_at = {}, {}
    for i in range(9):
        run.step(i)
        local_at[i + 1], global_at[i + 1] = run.floating("local"), run.floating("global")
    in_flight = s.schedule.buffers_inflight is not None
    snap = copy.deepcopy({"model": run.model.state_dict(), "opt": run.opt.state_dict(), "strategy": s.state_dict()})
    waited_in_steps = list(waited)  # finish waits (it lands everything, then averages blocking): not counted
    s.finish(run.model)
    other = _BNRun(world, spec)  # resumed from the snapshot taken with the buffers' average in flight
    other.model.load_state_dict(snap["model"])
    other.opt.load_state_dict(snap["opt"])
    other.strategy.load_state_dict(snap["strategy"])
    other.strategy.finish(other.model)
    return {
        "waited": waited_in_steps,
        "local_at": local_at,
        "global_at": global_at,
        "in_flight": in_flight,
        "final_local": run.floating("local"),
        "final_global": run.floating("global"),
        "resumed_global": other.floating("global"),
        "params": s.global_flat.numpy().copy(),
        "resumed_params": other.strategy.global_flat.numpy().copy(),
    }


def _bn_adapt(world) -> dict:
    return _bn(world, BN_ADAPT_SPEC)


@pytest.fixture(scope="module", params=["streaming", "adaptive"])
def bn_ranks(request):
    return run_world(_bn if request.param == "streaming" else _bn_adapt, size=2, islands=2)


def test_cycle_end_does_not_wait_for_fragments_in_flight_to_average_buffers(bn_ranks):
    for r in bn_ranks:
        assert r["waited"] == []  # nothing went through in_order (which waits for every exchange in flight)
        assert r["in_flight"]  # after step 9 the average started at step 8 is still out


def test_buffer_average_lands_one_cycle_late_in_the_global_model(bn_ranks):
    a, b = bn_ranks
    started_at_4 = (a["local_at"][4] + b["local_at"][4]) / 2
    assert np.abs(a["local_at"][4] - b["local_at"][4]).max() > 1e-3  # the islands' statistics differ
    for r in bn_ranks:
        assert np.array_equal(r["global_at"][4], r["global_at"][1])  # nothing landed at the first cycle end
        assert np.allclose(r["global_at"][8], started_at_4, atol=1e-6)  # step 4's average, landed at step 8


def test_finish_averages_buffers_everywhere_and_a_resume_with_them_in_flight_matches(bn_ranks):
    a, b = bn_ranks
    assert np.array_equal(a["final_global"], b["final_global"])
    for r in bn_ranks:
        assert np.array_equal(r["final_local"], r["final_global"])  # the islands adopted the average
        assert r["resumed_global"].tobytes() == r["final_global"].tobytes()
        assert r["resumed_params"].tobytes() == r["params"].tobytes()


# ---- the utilisation bench's pure parts ------------------------------------------------------------------------------


def test_utilisation_bench_splits_a_model_into_torchft_fragments_sharing_its_parameters():
    from islands.models import ByteTransformer
    from islands_bench.experiments.utilisation import torchft_fragments, utilisation_of
    from islands_bench.experiments.utilisation_torchft_worker import fragments_of

    model = ByteTransformer(d_model=16, n_layers=4, n_heads=2, context=8)
    params = list(model.parameters())
    parts = fragments_of(model, 4)
    got = [p for part in parts for p in part.parameters()]
    assert len(got) == len(params) and all(a is b for a, b in zip(got, params))  # the same objects, in order
    sizes = [sum(p.numel() for p in part.parameters()) for part in parts]
    assert max(sizes) < 2 * sum(sizes) / 4  # about equal
    with pytest.raises(ValueError, match=re.escape("fragments must be in 1..")):
        fragments_of(model, len(params) + 1)
    assert utilisation_of(1.0, 50.0) == pytest.approx(0.98)
    with pytest.raises(ValueError, match="blocked <= wall"):
        utilisation_of(60.0, 50.0)
    assert [torchft_fragments(h, 4) for h in (20, 50, 16)] == [4, 5, 4]  # a divisor of H (torchft's rule) nearest 4
