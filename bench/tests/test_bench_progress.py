"""Progress lines of `islands bench`: arms done and left, the time-left arithmetic, --reuse, and the wiring
into BenchContext.train (with a fake launch, no training)."""

import json

import pytest

import islands.app.launch as launch_mod
from islands_bench import harness
from islands_bench.harness import BenchContext
from islands_bench.progress import Previous, Progress, clock, load_previous, previous_arms


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_clock_format():
    assert [clock(s) for s in (0, 4.4, 59.6, 100, 250, 3600, 3725)] == [
        "0s",
        "4s",
        "1m00s",
        "1m40s",
        "4m10s",
        "1h00m",
        "1h02m",
    ]


def test_the_line_names_the_arm_the_count_and_the_time_left():
    now = Clock()
    p = Progress(now=now)
    p.plan(4)
    assert p.start("ddp") == "[1/4] ddp · done 0 in 0s"  # nothing measured, nothing before: no estimate
    now.t += 50
    assert p.finish() == "[1/4] ddp finished in 50s · done 1 in 50s · about 2m30s left"  # 3 more at 50 s
    now.t += 10  # work between arms counts in the elapsed time, not in an arm's
    assert p.start("diloco-H100") == "[2/4] diloco-H100 · done 1 in 1m00s · about 2m30s left"
    now.t += 70
    assert p.finish().endswith("· done 2 in 2m10s · about 2m00s left")  # mean of 50 and 70, twice
    for label in ("a", "b"):
        p.start(label)
        now.t += 60
        last = p.finish()
    assert last == "[4/4] b finished in 1m00s · done 4 in 4m10s · all arms done"


def test_without_a_plan_or_a_previous_result_the_count_is_unknown():
    now = Clock()
    p = Progress(now=now)
    assert p.start("x") == "[1/?] x · done 0 in 0s"
    now.t += 5
    assert p.finish() == "[1/?] x finished in 5s · done 1 in 5s"


def test_the_previous_result_gives_the_count_and_each_arm_its_own_duration():
    now = Clock()
    before = Previous(count=3, seconds={"ddp": 100.0, "diloco-H10": 300.0, "diloco-H100": 200.0})
    p = Progress(previous=before, now=now)
    # all three arms still to run, by their own previous durations
    assert p.start("ddp") == "[1/3] ddp · done 0 in 0s · about 10m00s left"
    now.t += 50  # this machine is twice as fast on ddp: the others are scaled by 0.5
    assert p.finish() == "[1/3] ddp finished in 50s · done 1 in 50s · about 4m10s left"
    assert p.start("diloco-H100") == "[2/3] diloco-H100 · done 1 in 50s · about 4m10s left"
    assert p.seconds_left() == pytest.approx(0.5 * (200 + 300))


def test_a_plan_overrides_the_previous_count_and_arms_beyond_it_still_count():
    now = Clock()
    p = Progress(previous=Previous(count=2, seconds={"a": 10.0, "b": 20.0}), now=now)
    p.plan(3)
    assert p.start("a").startswith("[1/3] a")
    assert p.seconds_left() == pytest.approx(10 + 20 + 15)  # a, b, then the mean of the previous arms
    now.t += 1
    p.finish()
    for label in ("b", "c"):
        p.start(label)
        now.t += 1
        p.finish()
    assert p.start("d").startswith("[4/4] d")  # more arms than planned: the count grows, never goes negative
    assert p.seconds_left() == pytest.approx(1.0)


def test_reused_arms_count_as_done_at_once_and_not_as_speed():
    now = Clock()
    p = Progress(previous=Previous(count=3, seconds={"a": 100.0, "b": 100.0, "c": 100.0}), now=now)
    now.t += 2
    assert p.reused("a") == "[1/3] a reused (--reuse) · done 1 in 0s · about 3m20s left"
    assert p.reused("b").startswith("[2/3] b reused (--reuse) · done 2")
    assert p.start("c").endswith("about 1m40s left")  # the previous 100 s, not the 0 s of a reused arm
    assert [a["reused"] for a in p.record()] == [True, True]


def test_previous_arms_from_arm_times_and_from_older_runs():
    newer = {
        "arm_times": [{"label": "a", "seconds": 12.0, "reused": False}, {"label": "b", "seconds": 0.0, "reused": True}]
    }
    assert previous_arms(newer) == Previous(count=2, seconds={"a": 12.0})
    older = {
        "seconds": 400.0,
        "runs": [
            {"label": "a", "summary": {"wall_seconds": 100.0}},
            {"label": "b", "summary": {"wall_seconds": 200.0}},
            {"label": "c", "summary": {}},
        ],
    }
    # 100 s the runs' wall clocks leave out (start-up, probes), spread over the 3 runs
    got = previous_arms(older)
    assert got.count == 3 and got.seconds == pytest.approx({"a": 100 + 100 / 3, "b": 200 + 100 / 3})
    assert previous_arms({"runs": []}) is None and previous_arms({"runs": "odd"}) is None
    assert previous_arms([1, 2]) is None


def test_load_previous_reads_a_real_result_and_survives_a_broken_one(tmp_path):
    path = tmp_path / "result.json"
    assert load_previous(path) is None
    path.write_text("{broken")
    assert load_previous(path) is None
    path.write_text(json.dumps({"seconds": 10.0, "runs": [{"label": "x", "summary": {"wall_seconds": 4.0}}]}))
    assert load_previous(path) == Previous(count=1, seconds={"x": 10.0})


def test_plan_refuses_nonsense():
    with pytest.raises(ValueError):
        Progress().plan(0)
    with pytest.raises(ValueError):
        BenchContext(name="x", quick=True, out_dir=None).plan(True)


@pytest.fixture
def fake_launch(monkeypatch):
    calls = []

    def launch(cfg, run_dir):
        calls.append(run_dir.name)
        run_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "config": cfg.to_dict(),
            "summary": {"final_val_loss": 1.0},
            "interconnect": {},
            "baseline": {"definition": "one worker"},
        }
        (run_dir / "run.json").write_text(json.dumps(record))
        return 0 if run_dir.name != "broken" else 3

    monkeypatch.setattr(launch_mod, "launch", launch)
    return calls


def _logged(ctx):
    lines = []
    ctx.log = lines.append
    return lines


def test_bench_context_train_prints_a_line_when_each_arm_starts_and_ends(tmp_path, fake_launch):
    ctx = BenchContext(name="x", quick=True, out_dir=tmp_path)
    lines = _logged(ctx)
    ctx.plan(2)
    ctx.train("ddp", task="digits", steps=3, workers=1)
    progress = [line for line in lines if line.startswith("[")]
    assert progress[0].startswith("[1/2] ddp · done 0") and progress[1].startswith("[1/2] ddp finished in")
    assert "left" in progress[1]  # one arm measured: the second is estimated from it
    with pytest.raises(RuntimeError):
        ctx.train("broken", task="digits", steps=3, workers=1)
    assert lines[-1].startswith("broken failed after")
    assert fake_launch == ["ddp", "broken"]


def test_a_reused_arm_in_train_counts_as_done(tmp_path, fake_launch):
    BenchContext(name="x", quick=True, out_dir=tmp_path).train("ddp", task="digits", steps=3, workers=1)
    ctx = BenchContext(name="x", quick=True, out_dir=tmp_path, reuse=True)
    lines = _logged(ctx)
    ctx.plan(2)
    ctx.train("ddp", task="digits", steps=3, workers=1)
    assert any(line.startswith("[1/2] ddp reused (--reuse) · done 1") for line in lines)
    assert fake_launch == ["ddp"] and ctx.progress.record()[0]["reused"] is True


def test_run_reads_the_previous_result_and_records_the_arm_times(tmp_path, fake_launch, monkeypatch):
    def two_arms(ctx):
        ctx.train("a", task="digits", steps=3, workers=1)
        ctx.train("b", task="digits", steps=3, workers=1)
        return {"rows": [], "headline": []}

    seen = []
    monkeypatch.setitem(harness.REGISTRY, "two-arms", harness.Experiment("two-arms", two_arms, (), "test"))
    monkeypatch.setattr(harness, "load_all", lambda: harness.REGISTRY)
    monkeypatch.setattr(harness, "versions", lambda: {"git_revision": "x", "torch": "x"})
    real_arm = BenchContext.arm

    def spy(self, label):
        seen.append(self.progress.total)
        return real_arm(self, label)

    monkeypatch.setattr(BenchContext, "arm", spy)
    out = harness.run("two-arms", quick=True, out_root=tmp_path)
    record = json.loads((out / "result.json").read_text())
    assert [a["label"] for a in record["arm_times"]] == ["a", "b"] and seen == [None, None]
    harness.run("two-arms", quick=True, out_root=tmp_path)  # the second invocation knows there are 2 arms
    assert seen[2:] == [2, 2]
