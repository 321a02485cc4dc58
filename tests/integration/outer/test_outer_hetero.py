"""Islands of different speeds: the slowdown component, DiLoCo adapt=speed|deadline, the samples-weighted mean.

The multi-process checks run 2 (and 3) gloo ranks, one island each, stepped by hand in the trainer's hook order with
a fake clock: each rank's step "takes" a fixed number of fake seconds between on_batch and after_step, so the plans
and deadlines are deterministic. One more check runs the real Trainer with a real (sleeping) slowdown.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from harness.flags import flags
from harness.outer import assert_train_refuses, batch, run_world, tiny_model

# ---- one process -----------------------------------------------------------------------------------


def test_plan_steps_is_proportional_to_speed_and_bounded():
    from islands.sync.outer.adaptive import plan_steps

    assert plan_steps(50, 0.1, 0.1) == 50  # the fastest island takes H
    assert plan_steps(50, 0.1, 0.2) == 25  # 2x slower: half
    assert plan_steps(50, 0.1, 0.3) == 17  # round(16.67)
    assert plan_steps(50, 0.1, 100.0) == 1  # never fewer than one step
    assert plan_steps(50, 0.1, float("nan")) == 50  # nothing measured: a plain round


def test_catch_up_cuts_only_the_lag_behind_the_earliest_island_within_half_a_budget():
    from islands.sync.outer.adaptive import catch_up

    assert catch_up(8.0, 0.0, 0.0) == 8.0  # the earliest island: a full budget
    assert catch_up(8.0, 2.0, 0.0) == 6.0  # 2 s behind, nothing cut yet: 2 s shorter
    assert catch_up(8.0, 2.0, 2.0) == 8.0  # the round in progress already made it up
    assert catch_up(8.0, 3.0, 2.0) == 7.0  # and the rest
    assert catch_up(8.0, 0.0, 3.0) == 8.0  # never lengthened (the fastest island takes at most H steps)
    assert catch_up(8.0, 30.0, 0.0) == 4.0  # far behind, or clocks that disagree: never under half a budget


def test_weight_scale_makes_the_plain_mean_the_weighted_mean():
    from islands.sync.outer.adaptive import weight_scale

    samples = [30.0, 10.0, 20.0]
    d = [np.float64(1.5), np.float64(-2.0), np.float64(4.0)]
    plain_mean_of_contributions = sum(weight_scale(samples, r) * d[r] for r in range(3)) / 3
    assert plain_mean_of_contributions == pytest.approx((30 * 1.5 - 10 * 2.0 + 20 * 4.0) / 60, rel=1e-15)
    assert weight_scale([5.0, 5.0], 0) == 1.0
    with pytest.raises(ValueError, match="samples"):
        weight_scale([0.0, 0.0], 0)


def test_parse_slowdown_forms_and_errors():
    from islands.faults.slowdown import SlowdownError, check_slowdown, factor_for, parse_slowdown

    s = parse_slowdown("1=2.0, rank3=1.5,island0=1")
    assert s == {("island", 1): 2.0, ("rank", 3): 1.5, ("island", 0): 1.0}
    assert factor_for(s, rank=3, island=1) == 2.0 and factor_for(s, rank=3, island=0) == 1.5
    assert factor_for(s, rank=0, island=0) == 1.0
    assert parse_slowdown("") == {}
    assert parse_slowdown("1=2,floor=0.05")[("floor", 0)] == 0.05
    check_slowdown(parse_slowdown("1=2,floor=0.05"), islands=2, workers=2)  # floor is not a target
    for bad, words in (
        ("1", "target=factor"),
        ("x=2", "target=factor"),
        ("1=fast", "target=factor"),
        ("1=0.5", ">= 1"),
        ("1=inf", ">= 1"),
        ("1=2,island1=3", "twice"),
        ("floor=-1", "floor"),
        ("floor=1,floor=2", "once"),
    ):
        with pytest.raises(SlowdownError, match=words):
            parse_slowdown(bad)
    with pytest.raises(SlowdownError, match=r"0\.\.1"):
        check_slowdown(parse_slowdown("2=2"), islands=2, workers=4)
    check_slowdown(parse_slowdown("rank3=2"), islands=2, workers=4)


def test_slow_step_sleeps_factor_minus_one_times_the_call_and_keeps_its_result():
    from islands.faults.slowdown import SlowStep
    from islands.memory.step import ForwardBackward

    clock = {"t": 0.0}
    slept = []

    def work(x):
        clock["t"] += 0.25  # the call "takes" 0.25 s
        return x * 2

    step = SlowStep(work, 3.0, sleep=slept.append, timer=lambda: clock["t"])
    assert step(21) == 42
    assert slept == [0.5] and step.slept == 0.5 and step.worked == 0.25
    padded = SlowStep(work, 2.0, floor=1.0, sleep=slept.append, timer=lambda: clock["t"])
    assert padded(1) == 2 and slept[-1] == 2 * 1.0 - 0.25  # the step counts as the floor, then doubles
    even = SlowStep(work, 1.0, floor=0.1, sleep=slept.append, timer=lambda: clock["t"])
    even(1)
    assert len(slept) == 2  # already over the floor at factor 1: no sleep
    fb = SlowStep(ForwardBackward(micro_batch=4, precision="bf16"), 2.0)
    assert fb.micro_batch == 4 and fb.record() == {"micro_batch": 4, "precision": "bf16"}  # the wrapped step's


@pytest.mark.parametrize(
    "spec, words",
    [
        ("diloco:adapt=fast", ["adapt must be one of none, speed, deadline", "'fast'"]),
        ("diloco:deadline=3", ["deadline=3.0 applies to adapt=deadline only"]),
        ("diloco:adapt=deadline,deadline=-1", ["deadline must be >= 0"]),
        ("diloco:adapt=speed,inner_steps=4,fragments=2", ["whole-model DiLoCo rounds", "fragments=2"]),
        ("diloco:adapt=deadline,overlap=eager,inner_steps=4,fragments=2", ["whole-model", "fragments=2"]),
        ("diloco:adapt=speed,aggregator=median", ["robust aggregator"]),
    ],
)
def test_bad_adapt_specs_exit_2_naming_the_choices(spec, words, tmp_path, capsys):
    assert_train_refuses(spec, words, tmp_path, capsys)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--world.slowdown", "5=2"], ["island 5", "0..1", "target=factor"]),
        (["--world.slowdown", "1=0.5"], [">= 1"]),
        (["--world.slowdown", "one=2"], ["target=factor", "rank3"]),
        (
            ["--outer", "diloco:inner_steps=10,adapt=speed", "--ckpt-every", "15"],
            ["multiple of inner_steps (10)", "10"],
        ),
    ],
)
def test_bad_slowdown_and_checkpoint_intervals_exit_2(flags, words, tmp_path, capsys):
    from islands.cli import main

    args = ["train", "--workers", "2", "--islands", "2", "--run-dir", str(tmp_path / "r")]
    if "--outer" not in flags:
        args += ["--outer", "diloco:inner_steps=10"]
    with pytest.raises(SystemExit) as e:
        main(args + flags)
    err = capsys.readouterr().err
    assert e.value.code == 2
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "r").exists()


# ---- several processes, a fake clock ---------------------------------------------------------------


class FakeClock:
    def __init__(self, start: float = 0.0):
        self.t = start

    def __call__(self) -> float:
        return self.t


class Run:
    """A tiny model, AdamW and an adaptive DiLoCo, stepped by hand in the trainer's hook order, the step counter
    following next_step; each step costs `cost(step)` fake seconds on this rank. Records every exchange."""

    def __init__(self, world, spec: str, rows: int = 4, start: float = 0.0):
        from islands.sync.outer import make_outer
        from islands.sync.outer.adaptive import Adaptive

        self.world, self.rows = world, rows
        self.model = tiny_model()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.strategy = make_outer(spec)
        self.strategy.wrap(self.model, self.opt, world)
        self.clock = FakeClock(start)
        self.exchanges: list[dict] = []
        s = self.strategy
        if not isinstance(s.schedule, Adaptive):  # plain rounds: nothing measured, no weighted exchange to spy on
            self.step, self.visited = 0, []
            return
        s.schedule.meter.timer = s.schedule.meter.wallclock = self.clock  # every rank's clock starts at `start`
        original = s.schedule._exchange

        def spy():
            before = {
                "global": s.global_flat.numpy().copy(),
                "local": s.local.read().numpy().copy(),
                "samples": s.schedule.meter.samples,
                "steps": s.schedule.meter.steps,
            }
            original()
            before["after"] = s.global_flat.numpy().copy()
            self.exchanges.append(before)

        s.schedule._exchange = spy
        self.step = 0
        self.visited: list[int] = []

    def one(self, cost: float) -> None:
        from islands.models import sequence_loss

        i = self.step
        self.visited.append(i)
        b = batch(self.world.rank, i)[: self.rows]
        b = self.strategy.on_batch(b, i)
        self.clock.t += cost
        sequence_loss(self.model(b[:, :-1]), b[:, 1:]).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.strategy.after_step(self.model, self.opt, i)
        self.step = self.strategy.next_step(i + 1)

    def until(self, steps: int, cost) -> None:
        while self.step < steps:
            self.one(cost(self.step))

    def snapshot(self) -> dict:
        return copy.deepcopy(
            {
                "model": self.model.state_dict(),
                "opt": self.opt.state_dict(),
                "strategy": self.strategy.state_dict(),
                "step": self.step,
            }
        )

    def restore(self, snap: dict) -> None:
        self.model.load_state_dict(snap["model"])
        self.opt.load_state_dict(snap["opt"])
        self.strategy.load_state_dict(copy.deepcopy(snap["strategy"]))
        self.step = snap["step"]


H = 8


def _speed(world) -> dict:
    """Rank 1 2x slower for 4 rounds, then 4x slower; run 7 rounds plus a 3-step tail (final sync)."""
    slow = world.rank == 1

    def cost(step):
        return (2.0 if step < 4 * H else 4.0) if slow else 1.0

    run = Run(world, f"diloco:inner_steps={H},adapt=speed,outer=sgd,outer_lr=1", rows=2 if slow else 4)
    run.until(7 * H + 3, cost)
    run.strategy.finish(run.model)
    s = run.strategy
    return {
        "history": s.schedule.history,
        "visited": run.visited,
        "exchanges": run.exchanges,
        "rates": s.schedule.rates,
        "global": s.global_flat.numpy().copy(),
        "sends": s.schedule.sends[0],
        "rounds": s.rounds,
    }


def _deadline(world) -> dict:
    slow = world.rank == 1
    out = {}
    for label, spec in (
        ("auto", f"diloco:inner_steps={H},adapt=deadline"),
        ("given", f"diloco:inner_steps={H},adapt=deadline,deadline=3"),
    ):
        run = Run(world, spec)
        run.until(4 * H, lambda step: 2.0 if slow else 1.0)
        run.strategy.finish(run.model)
        out[label] = {
            "history": run.strategy.schedule.history,
            "budget": run.strategy.schedule.budget,
            "global": run.strategy.global_flat.numpy().copy(),
        }
    return out


def _equal_speeds_is_plain(world) -> dict:
    out = {}
    for label, spec in (
        ("plain", "diloco:inner_steps=3"),
        ("speed", "diloco:inner_steps=3,adapt=speed"),
        ("deadline", "diloco:inner_steps=3,adapt=deadline"),
    ):
        run = Run(world, spec)
        if label == "plain":
            for _ in range(10):  # no on_batch timing needed; the same hook order
                run.one(1.0)
        else:
            run.until(10, lambda step: 1.0)
        run.strategy.finish(run.model)
        out[label] = run.strategy.global_flat.numpy().copy()
    return out


def _resume(world) -> dict:
    """Cut in the middle of a round in which rank 1 plans fewer steps; the restored run continues bit for bit."""
    slow = world.rank == 1
    out = {}
    for label, spec in (
        ("speed", f"diloco:inner_steps={H},adapt=speed,{PAPER}"),
        ("deadline", f"diloco:inner_steps={H},adapt=deadline,compressor=(int4:ef=true)"),
    ):
        cost = (lambda step: 3.0) if slow else (lambda step: 1.0)
        a = Run(world, spec)
        a.until(2 * H + 1, cost)  # rank 1 is one step into its short third round
        snap = a.snapshot()
        a.until(5 * H + 2, cost)
        a.strategy.finish(a.model)
        b = Run(world, spec, start=12345.0)  # another clock origin: only differences count
        b.restore(snap)
        restored = b.strategy.state_dict()
        b.until(5 * H + 2, cost)
        b.strategy.finish(b.model)
        out[label] = {
            "a": a.strategy.global_flat.numpy().copy(),
            "b": b.strategy.global_flat.numpy().copy(),
            "a_local": a.strategy.local.read().numpy().copy(),
            "b_local": b.strategy.local.read().numpy().copy(),
            "a_hist": a.strategy.schedule.history,
            "b_hist": b.strategy.schedule.history,
            "same_state": _same(snap["strategy"], restored),
            "snap_round_steps": snap["strategy"]["adapt"]["round_steps"],
        }
    return out


PAPER = "outer=nesterov,outer_lr=0.7,momentum=0.9"  # a momentum buffer: outer state that must come back too


def _same(x, y) -> bool:
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    return x == y and type(x) is type(y)


def _warm(world) -> dict:
    """adapt=speed inside WarmStart: 3 steps of gradient averaging, then rounds of 4 on the outer strategy's clock."""
    from islands.models import sequence_loss
    from islands.sync.outer import make_outer

    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ws = make_outer("diloco:inner_steps=4,adapt=speed,warm_start=3")
    ws.wrap(model, opt, world)
    clock = FakeClock()
    ws.outer.schedule.meter.timer = clock
    step, visited = 0, []
    while step < 3 + 3 * 4:
        visited.append(step)
        b = ws.on_batch(batch(world.rank, step), step)
        clock.t += 2.0 if world.rank == 1 else 1.0
        sequence_loss(model(b[:, :-1]), b[:, 1:]).backward()
        ws.after_backward(model, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ws.after_step(model, opt, step)
        step = ws.next_step(step + 1)
    ws.finish(model)
    return {"history": ws.outer.schedule.history, "visited": visited, "global": ws.outer.global_flat.numpy().copy()}


def _spy_weighted(run: Run) -> list[dict]:
    """Every weighted exchange of an overlapped run: this island's contribution and the mean that came back."""
    s, original, seen = run.strategy, run.strategy.schedule._weighted_mean, []

    def spy(mine, delta):
        entry = {"samples": float(mine[0]), "delta": delta.numpy().copy()}
        gathered, mean = original(mine, delta)
        entry.update(n=gathered[:, 0].tolist(), mean=mean.numpy().copy())
        seen.append(entry)
        return gathered, mean

    s.schedule._weighted_mean = spy
    return seen


def _overlapped(world) -> dict:
    """adapt with overlap=eager|delayed: zero delay is plain adaptive rounds; a round's delay plans one round later;
    a resume with an exchange in flight continues bit for bit."""
    slow = world.rank == 1
    cost = (lambda step: 2.0) if slow else (lambda step: 1.0)
    out = {}
    for label, spec, delay in (
        ("plain", f"diloco:inner_steps={H},adapt=speed,{PAPER}", None),
        ("eager-d0", f"diloco:inner_steps={H},adapt=speed,overlap=eager,{PAPER}", 0),
        ("delayed-d0", f"diloco:inner_steps={H},adapt=speed,overlap=delayed,{PAPER}", 0),
    ):
        run = Run(world, spec, rows=2 if slow else 4)
        if delay is not None:
            run.strategy.schedule.delay = delay
        run.until(5 * H + 3, cost)
        run.strategy.finish(run.model)
        out[label] = {"global": run.strategy.global_flat.numpy().copy(), "history": run.strategy.schedule.history}
    for mode in ("eager", "delayed"):
        run = Run(
            world, f"diloco:inner_steps={H},adapt=deadline,overlap={mode},outer=sgd,outer_lr=1", rows=2 if slow else 4
        )
        seen = _spy_weighted(run)
        boundary_globals = []
        original = run.strategy.schedule._land_round

        def land(run=run, original=original, boundary_globals=boundary_globals):
            before = run.strategy.global_flat.numpy().copy()
            had = run.strategy.schedule.round_inflight is not None
            original()
            if had:
                boundary_globals.append((before, run.strategy.global_flat.numpy().copy()))

        run.strategy.schedule._land_round = land
        run.until(5 * H, cost)
        inflight_at_end = run.strategy.schedule.round_inflight is not None
        run.strategy.finish(run.model)
        out[mode] = {
            "history": run.strategy.schedule.history,
            "seen": seen,
            "landed": boundary_globals,
            "visited": run.visited,
            "inflight_at_end": inflight_at_end,
            "rounds": run.strategy.rounds,
            "global": run.strategy.global_flat.numpy().copy(),
            "local": run.strategy.local.read().numpy().copy(),
        }
    spec = f"diloco:inner_steps={H},adapt=deadline,overlap=eager,compressor=(topkq:ratio=0.2,bits=4),{PAPER}"
    a = Run(world, spec)
    a.until(2 * H + 1, cost)  # round 2's exchange in flight, rank 1 one step into its 2-step third round
    snap, at = a.snapshot(), a.clock.t
    a.until(5 * H + 2, cost)
    a.strategy.finish(a.model)
    # the islands' clocks go on from where they were, shifted alike: catching up reads how far apart the islands
    # ended their rounds on the wall clock, which a restart of both resets in a real run
    b = Run(world, spec, start=at + 777.0)
    b.restore(snap)
    restored = b.strategy.state_dict()
    b.until(5 * H + 2, cost)
    b.strategy.finish(b.model)
    out["resume"] = {
        "same_state": _same(snap["strategy"], restored),
        "inflight": "inflight_mean" in snap["strategy"]["adapt"],
        "snap_step": snap["step"],
        "snap_round_steps": snap["strategy"]["adapt"]["round_steps"],
        "a": a.strategy.global_flat.numpy().copy(),
        "b": b.strategy.global_flat.numpy().copy(),
        "a_local": a.strategy.local.read().numpy().copy(),
        "b_local": b.strategy.local.read().numpy().copy(),
        "a_hist": a.strategy.schedule.history,
        "b_hist": b.strategy.schedule.history,
    }
    # both islands equally fast, 1 s a step in round 1 and 1.5 s after it: round 2 runs 12 s against the 8 s
    # budget learnt from round 1, on both islands alike, which is no lag to make up
    run = Run(world, f"diloco:inner_steps={H},adapt=deadline,overlap=eager,{PAPER}")
    run.until(5 * H, lambda step: 1.0 if step < H else 1.5)
    run.strategy.finish(run.model)
    out["slower_everywhere"] = {"history": run.strategy.schedule.history, "budget": run.strategy.schedule.budget}
    return out


def _two(world) -> dict:
    torch.manual_seed(world.rank)
    return {
        "speed": _speed(world),
        "deadline": _deadline(world),
        "plain": _equal_speeds_is_plain(world),
        "resume": _resume(world),
        "warm": _warm(world),
        "overlap": _overlapped(world),
    }


def _three(world) -> dict:
    torch.manual_seed(world.rank)
    cost = {0: 1.0, 1: 2.0, 2: 3.0}[world.rank]
    run = Run(world, "diloco:inner_steps=6,adapt=speed,outer=sgd,outer_lr=1", rows=2 + world.rank)
    run.until(4 * 6, lambda step: cost)
    run.strategy.finish(run.model)
    return {
        "history": run.strategy.schedule.history,
        "exchanges": run.exchanges,
        "global": run.strategy.global_flat.numpy(),
    }


def _four(world) -> dict:
    """2 islands x 2 workers: island 1's workers measure 2 and 3 fake s per step; each island must agree."""
    torch.manual_seed(world.rank)
    cost = {0: 1.0, 1: 1.0, 2: 2.0, 3: 3.0}[world.rank]
    out = {}
    for mode in ("speed", "deadline"):
        run = Run(world, f"diloco:inner_steps={H},adapt={mode}")
        run.until(3 * H, lambda step: cost)
        run.strategy.finish(run.model)
        out[mode] = {"history": run.strategy.schedule.history, "visited": run.visited}
    return out


@pytest.fixture(scope="module")
def two():
    return run_world(_two, size=2, islands=2)


def test_speed_adaptive_h_follows_the_measured_speed(two):
    for r in two:
        h = r["speed"]["history"]
        # round 1: H everywhere (nothing measured); then 2x slower -> H/2; round 5 (counted steps 32..39) is the
        # first at 4x, measured at its exchange -> H/4 from round 6; the final partial round: rank 0 reaches the
        # run's end after 3 steps, rank 1 takes its planned 2 and sends (its counter then skips past the end)
        assert h == [
            [H, H],
            [H, H // 2],
            [H, H // 2],
            [H, H // 2],
            [H, H // 2],
            [H, H // 4],
            [H, H // 4],
            [3, H // 4],
        ], h
        assert r["speed"]["rounds"] == r["speed"]["sends"] == len(h)
    assert two[0]["speed"]["rates"] == pytest.approx([1.0, 4.0])
    # the slow island skips the counted steps it did not compute: it visits step 8..11, then 16..19, ...
    assert two[1]["speed"]["visited"][H : H + 5] == [H, H + 1, H + 2, H + 3, 2 * H]
    assert two[0]["speed"]["visited"] == list(range(7 * H + 3))


def test_weighted_mean_is_the_samples_weighted_average_two_ranks(two):
    ex0, ex1 = two[0]["speed"]["exchanges"], two[1]["speed"]["exchanges"]
    assert len(ex0) == len(ex1) == 8
    for k, (a, b) in enumerate(zip(ex0, ex1)):
        g = a["global"]
        assert g.tobytes() == b["global"].tobytes()
        n = np.array([a["samples"], b["samples"]], dtype=np.float64)
        assert n[1] == b["steps"] * 2 and n[0] == a["steps"] * 4  # samples = steps x rows of each rank's batches
        d = [g.astype(np.float64) - x["local"].astype(np.float64) for x in (a, b)]
        want = g.astype(np.float64) - (n[0] * d[0] + n[1] * d[1]) / n.sum()  # outer SGD lr 1: global - mean
        got = a["after"].astype(np.float64)
        assert np.abs(got - want).max() <= 1e-6 * max(1.0, np.abs(want).max()), k
        # bit for bit what the two fp32 contributions sum to (a two-rank all-reduce adds them in either order)
        if n[0] != n[1]:
            c = [(g - x["local"]) * np.float32(len(n) * n[i] / n.sum()) for i, x in enumerate((a, b))]
            assert a["after"].tobytes() == (g - (c[0] + c[1]) / np.float32(2)).tobytes(), k
        # and it is not the unweighted mean whenever the samples differ
        if n[0] != n[1]:
            assert np.abs(got - (g - (d[0] + d[1]) / 2)).max() > 1e-6
    assert two[0]["speed"]["global"].tobytes() == two[1]["speed"]["global"].tobytes()


def test_weighted_mean_three_ranks():
    ranks = run_world(_three, size=3, islands=3)
    assert ranks[0]["history"][:3] == [[6, 6, 6], [6, 3, 2], [6, 3, 2]]
    for k in range(len(ranks[0]["exchanges"])):
        ex = [r["exchanges"][k] for r in ranks]
        g = ex[0]["global"].astype(np.float64)
        n = np.array([e["samples"] for e in ex], dtype=np.float64)
        assert list(n) == [e["steps"] * (2 + i) for i, e in enumerate(ex)]
        want = g - sum(n[i] * (g - ex[i]["local"].astype(np.float64)) for i in range(3)) / n.sum()
        for e in ex:
            assert np.abs(e["after"].astype(np.float64) - want).max() <= 1e-6 * max(1.0, np.abs(want).max())
    assert ranks[0]["global"].tobytes() == ranks[1]["global"].tobytes() == ranks[2]["global"].tobytes()


def test_workers_of_one_island_agree_on_their_steps():
    ranks = run_world(_four, size=4, islands=2)
    for r in ranks:
        # the island is as slow as its slowest worker (3 s/step): speed plans round(8 / 3) = 3; under the deadline
        # (8 s) the 3 s worker stops after 3 steps (9 + 1.5 >= 8) and takes its island partner (4 alone) with it
        assert r["speed"]["history"] == [[H, H], [H, 3], [H, 3]]
        assert r["deadline"]["history"] == [[H, H], [H, 3], [H, 3]]
    assert ranks[2]["deadline"]["visited"] == ranks[3]["deadline"]["visited"]  # same counted steps on the island


def test_adaptive_rounds_after_a_warm_start(two):
    for r in two:
        assert r["warm"]["history"] == [[4, 4], [4, 2], [4, 2]]
    assert two[0]["warm"]["visited"] == list(range(15))
    assert two[1]["warm"]["visited"] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12]  # skips to each round's end
    assert two[0]["warm"]["global"].tobytes() == two[1]["warm"]["global"].tobytes()


def test_deadline_rounds_stop_at_the_budget(two):
    for r in two:
        auto, given = r["deadline"]["auto"], r["deadline"]["given"]
        # budget = fastest island's H steps = 8 fake s; rank 1 (2 s/step) stops where a next step would end more
        # than half a step past it: after 4 steps (8 s)
        assert auto["history"] == [[H, H], [H, 4], [H, 4], [H, 4]] and auto["budget"] == H * 1.0
        # 3 s given, from the first round: rank 0 stops after 3 steps (3 + 0.5 >= 3), rank 1 after 1 (2 + 1 >= 3)
        assert given["history"] == [[3, 1]] * 4 and given["budget"] == 3.0
    assert two[0]["deadline"]["auto"]["global"].tobytes() == two[1]["deadline"]["auto"]["global"].tobytes()


def test_equal_speeds_are_plain_diloco_bit_for_bit(two):
    for r in two:
        assert r["plain"]["speed"].tobytes() == r["plain"]["plain"].tobytes()
        assert r["plain"]["deadline"].tobytes() == r["plain"]["plain"].tobytes()


@pytest.mark.parametrize("mode", ["speed", "deadline"])
def test_resume_mid_round_is_bitwise(two, mode):
    for r in two:
        res = r["resume"][mode]
        assert res["same_state"]  # every piece of the adaptive state comes back as saved
        assert res["a"].tobytes() == res["b"].tobytes()
        assert res["a_local"].tobytes() == res["b_local"].tobytes()
        assert res["a_hist"] == res["b_hist"]
    assert two[1]["resume"][mode]["snap_round_steps"] == 1  # the cut really is inside rank 1's round
    assert two[0]["resume"][mode]["a_hist"][2][1] < H  # and rank 1's rounds really are short


def test_overlapped_adaptive_rounds_with_zero_delay_are_the_plain_ones_bit_for_bit(two):
    for r in two:
        o = r["overlap"]
        assert o["plain"]["history"][1][1] == H // 2  # the slow island really plans short rounds
        for label in ("eager-d0", "delayed-d0"):
            assert o[label]["history"] == o["plain"]["history"], label
            assert o[label]["global"].tobytes() == o["plain"]["global"].tobytes(), label


@pytest.mark.parametrize("mode", ["eager", "delayed"])
def test_overlapped_deadline_rounds_plan_one_round_later_and_weigh_by_samples(two, mode):
    for r in two:
        o = r["overlap"][mode]
        # rounds 1 and 2 take H (round 1's speeds land only at round 2's end); then the budget is the fastest
        # island's 8 fake s, and rank 1 (2 s a step), 8 s behind rank 0 at round 1's end, catches up: round 3 is
        # cut by min(8 - 0, 8 / 2) = 4 s to 4 s, 2 steps; rounds 4 and 5 by min(16 - 4, 4) and min(12 - 4, 4) (lags
        # 16 and 12 s at rounds 2 and 3); without catching up it would take 4 (the plain deadline rounds above)
        # and stay 16 s behind. The run ends on a boundary: nothing is left unsent, finish only lands the last round
        assert o["history"] == [[H, H], [H, H], [H, 2], [H, 2], [H, 2]], o["history"]
        assert o["rounds"] == 5 and o["inflight_at_end"]
        assert len(o["landed"]) == 5  # every exchange landed at the next boundary or in finish
    assert two[1]["overlap"][mode]["visited"][2 * H : 2 * H + 3] == [2 * H, 2 * H + 1, 3 * H]
    a, b = two[0]["overlap"][mode], two[1]["overlap"][mode]
    assert a["global"].tobytes() == b["global"].tobytes()
    for k, (x, y) in enumerate(zip(a["seen"], b["seen"])):
        n = np.array([x["samples"], y["samples"]])
        assert x["n"] == y["n"] == n.tolist()
        want = (n[0] * x["delta"].astype(np.float64) + n[1] * y["delta"].astype(np.float64)) / n.sum()
        assert np.abs(x["mean"] - want).max() <= 1e-6 * max(1.0, np.abs(want).max()), k
        assert x["mean"].tobytes() == y["mean"].tobytes()
        before, after = a["landed"][k]  # outer SGD lr 1: the landing steps global by exactly that mean
        assert np.abs(after.astype(np.float64) - (before - x["mean"])).max() <= 1e-6 * max(1.0, np.abs(before).max())
    assert a["seen"][2]["n"] == [H * 4, 2 * 2]  # round 3: 8 steps of 4 rows against 2 of 2 rows
    # after finish both islands hold the global model (the last landing adopted it)
    assert a["local"].tobytes() == a["global"].tobytes() and b["local"].tobytes() == b["global"].tobytes()


def test_overlapped_deadline_rounds_that_all_run_long_cut_nobody(two):
    for r in two:
        o = r["overlap"]["slower_everywhere"]
        # round 3's budget is round 1's 8 s: 5 steps of 1.5 s (a sixth would end more than half a step past it),
        # the same on both islands (a grid of absolute round ends had cut both to 4 s, 3 steps: the Llama run
        # of session 22); from round 4 the budget is round 2's 12 s, H steps
        assert o["history"] == [[H, H], [H, H], [5, 5], [H, H], [H, H]], o["history"]
        assert o["budget"] == 12.0


def test_overlapped_adaptive_resume_with_an_exchange_in_flight_is_bitwise(two):
    for r in two:
        res = r["overlap"]["resume"]
        assert res["inflight"] and res["same_state"]
        assert res["a"].tobytes() == res["b"].tobytes() and res["a_local"].tobytes() == res["b_local"].tobytes()
        assert res["a_hist"] == res["b_hist"] and res["a_hist"][2][1] < H
        assert res["snap_step"] == 2 * H + 1  # a checkpoint's counted step, the same on both ranks
    assert two[1]["overlap"]["resume"]["snap_round_steps"] == 1  # the cut is inside rank 1's short round


# ---- the Trainer, a real slowdown ------------------------------------------------------------------


def _trainer(world) -> dict:
    from islands.faults.slowdown import SlowStep
    from islands.loop.trainer import Trainer
    from islands.memory.step import ForwardBackward
    from islands.models import sequence_loss
    from islands.sync.outer import make_outer
    from islands.sync.stack import Stack

    torch.manual_seed(0)
    model = tiny_model()
    data = [batch(world.rank, i) for i in range(64)]
    # every step padded to 40 ms (the floor): the speeds are the factors', not the loaded host's CPU shares
    step_fn = SlowStep(ForwardBackward(), 2.0 if world.island == 1 else 1.0, floor=0.04)
    outer = make_outer("diloco:inner_steps=8,adapt=speed")
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        lambda out, y: sequence_loss(out, y),
        [(b[:, :-1], b[:, 1:]) for b in data],
        val_data=[(data[0][:, :-1], data[0][:, 1:])],
        strategy=Stack(outer=outer),
        world=world,
        step_fn=step_fn,
    )
    trainer.fit(36)
    return {
        "history": outer.schedule.history,
        "step": trainer.step,
        "global": outer.global_flat.numpy().copy(),
        "real_steps": trainer.steps_this_fit,
        "val": trainer.series["val"][-1]["val_loss"],
    }


def test_trainer_with_a_slowed_island_plans_half_the_steps():
    ranks = run_world(_trainer, size=2, islands=2)
    h = ranks[0]["history"]
    assert h[0] == [8, 8]
    for fast, slow in h[1:4]:  # measured 2x slower: about half (a loaded machine stretches the fast island's
        assert fast == 8 and 3 <= slow <= 6, h  # steps past the 40 ms floor too: 6 was seen in a full suite)
    assert len(h) == 5 and h[4][0] == 4 and 1 <= h[4][1] <= 4  # the last 4 counted steps, then the final sync
    assert ranks[0]["step"] == ranks[1]["step"] == 36  # both loops ended at the run's length
    assert ranks[1]["real_steps"] == sum(s for _, s in h) < ranks[0]["real_steps"] == 36
    assert ranks[0]["global"].tobytes() == ranks[1]["global"].tobytes()
    assert np.isfinite(ranks[0]["val"])


@pytest.mark.slow  # two worker processes through the launcher: ~15 s on an idle 2-core host
def test_islands_train_with_a_slowed_island_and_adaptive_rounds(tmp_path, capfd):
    """The whole path: `islands train --world.slowdown ... --outer diloco:...,adapt=speed` builds the slowed step on
    island 1 only, the run ends, and rank 0's report lists the steps each island took per round."""
    import json

    from harness.cli import islands_cli

    run_dir = tmp_path / "run"
    code = islands_cli(  # the CLI in this process (harness.cli)
        "train",
        *flags(task="digits", workers=2, islands=2, steps=20, warmup=2, eval_every=0, no_progress=True),
        *flags(no_probe=True, outer="diloco:inner_steps=5,adapt=speed", run_dir=run_dir),
        "--world.slowdown",
        "1=2.0,floor=0.03",
        timeout=240,
    )
    assert code == 0, capfd.readouterr().err[-3000:]
    rounds = json.loads((run_dir / "outer_exchanges.json").read_text())["steps_per_round"]
    assert rounds[0] == [5, 5] and len(rounds) == 4
    assert all(fast == 5 and 1 <= slow <= 4 for fast, slow in rounds[1:]), rounds  # island 1 takes fewer
    record = json.loads((run_dir / "run.json").read_text())
    assert record["summary"]["steps"] == 20 and record["config"]["world"]["slowdown"] == "1=2.0,floor=0.03"
