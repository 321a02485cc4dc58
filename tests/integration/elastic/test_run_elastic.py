"""`islands run --elastic`: a user's own loop (DiLoCo, the program of docs/own-model.md) as an elastic job.
A SIGKILLed worker is dropped and the survivors finish and agree bitwise; a worker started with `islands
join` enters at a round boundary with the members' global model, strategy state and step (its Checkpointer
loads nothing older) and ends with the same global model; a wrong token is refused with its exit code; a
script without an outer strategy fails with a message saying what is missing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import harness.elastic as elastic_jobs
from islands.checkpoint import CheckpointStore
from islands.runtime.elastic.membership import REFUSED_EXIT_CODE

TIMEOUT = 240

# The own-loop program with a digits-sized MLP on synthetic data. Test hooks, outside the program: at step
# --gate every member writes OUT/gate-NAME and waits for OUT/go, so the test acts while the job is mid-run; a
# joiner (a name starting with "j") asks to join only once OUT/admit exists.
SCRIPT = r"""
import argparse, json, os, time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import islands
from islands.runtime.elastic import global_digest

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--inner-steps", type=int, default=5)
p.add_argument("--ckpt", default="")
p.add_argument("--gate", type=int, default=-1)
p.add_argument("--hold-at", type=int, default=-1)
p.add_argument("--no-outer", action="store_true")
args = p.parse_args()
out, name = Path(args.out), os.environ["ISLANDS_NAME"]
out.mkdir(parents=True, exist_ok=True)
(out / f"pid-{name}").write_text(str(os.getpid()))

g = torch.Generator().manual_seed(0)
X = torch.randn(1200, 64, generator=g)
Y = (X @ torch.randn(64, 10, generator=g)).argmax(-1)


def my_batches(shard, shards, skip=0, batch=16):
    x, y = X[shard::shards], Y[shard::shards]
    step = skip
    while True:
        i = (step * batch) % (len(y) - batch)
        yield x[i : i + batch], y[i : i + batch]
        step += 1


torch.manual_seed(0)
deadline = time.monotonic() + 200
while name.startswith("j") and not (out / "admit").exists() and time.monotonic() < deadline:
    time.sleep(0.05)  # a joiner (started early, so that its start-up overlaps the job's) asks to join on cue
world = islands.init_world()
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
outer = None if args.no_outer else islands.outer.DiLoCo(inner_steps=args.inner_steps)
strategy = islands.Stack(inner=islands.inner.DDP(), outer=outer)
model = strategy.wrap(model, opt, world)
ckpt = islands.Checkpointer(args.ckpt, world, every=3) if args.ckpt else None
start = (ckpt.restore(model=model, optimizer=opt, strategy=strategy) or 0) if ckpt else world.start_step
for step, (x, y) in enumerate(my_batches(*world.shard, skip=start), start=start):
    if step >= args.steps:
        break
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    strategy.after_backward(model, step)
    opt.step(); opt.zero_grad()
    strategy.after_step(model, opt, step)
    if ckpt:
        ckpt.maybe_save(step + 1, model=model, optimizer=opt, strategy=strategy)
    if step + 1 == args.gate:
        (out / f"gate-{name}").write_text("")
        deadline = time.monotonic() + 200
        while not (out / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    if step + 1 == args.hold_at:  # a second wait, for OUT/go2 (a restarted island gets ready meanwhile)
        deadline = time.monotonic() + 200
        while not (out / "go2").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
strategy.finish(model)
if ckpt:
    ckpt.close()
m = world.membership
(out / f"{name}.json").write_text(json.dumps({
    "start": start, "start_step": world.start_step, "size": world.size, "islands": world.islands,
    "sha": global_digest(strategy.eval_model(model)), "events": m.state_dict()["events"],
    "rounds": [s["size"] for s in m.syncs if s["kind"] == "outer_delta"]}))
islands.close_world(world)
"""


def _wait(what, check, proc: subprocess.Popen, err: Path):
    return elastic_jobs.wait(check, what, TIMEOUT, proc=proc, log=err)


def _logs(tmp_path: Path) -> str:
    return elastic_jobs.logs(tmp_path / "run")


def test_sigkilled_worker_is_dropped_and_the_survivors_finish_and_agree_bitwise(tmp_path):
    out = tmp_path / "out"
    proc, err = elastic_jobs.start_job(tmp_path, SCRIPT, 3, "--out", "out", "--steps", "40", "--gate", "10")
    _wait("every worker at the gate", elastic_jobs.at_gate(out, ["w0", "w1", "w2"]), proc, err)
    os.kill(int((out / "pid-w2").read_text()), signal.SIGKILL)  # mid-run: two rounds done, six to go
    (out / "go").write_text("")
    log = elastic_jobs.finish(proc, err, TIMEOUT)
    assert proc.returncode == 0, log + _logs(tmp_path)
    assert "worker w2 left (killed by SIGKILL); the others carry on" in log
    recs = {n: json.loads((out / f"{n}.json").read_text()) for n in ("w0", "w1")}
    assert not (out / "w2.json").exists()
    assert len({r["sha"] for r in recs.values()}) == 1, "survivors disagree on the global model"
    for r in recs.values():
        assert r["start"] == 0 and r["size"] == 2 and r["islands"] == 2  # the world followed the members
        failures = [e for e in r["events"] if e["type"] == "failure"]
        assert len(failures) == 1 and failures[0]["gone"] == ["w2"]
        assert r["rounds"][:2] == [3, 3] and r["rounds"][-1] == 2 and len(r["rounds"]) == 8  # no round lost
    elastic_jobs.assert_nothing_half_written(tmp_path / "run")


def test_a_joiner_enters_at_a_round_boundary_and_ends_with_the_same_global_model(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc, err = elastic_jobs.start_job(
        tmp_path, SCRIPT, 2, "--out", "out", "--steps", "30", "--gate", "10", "--ckpt", "ckpt"
    )
    address = _wait("the job's address", lambda: elastic_jobs.address(err), proc, err)
    token_file = tmp_path / "run" / "token"
    # from another directory: the joiner runs the job's script where the launcher ran it (relative paths agree);
    # started now, its start-up overlaps the job's, and it asks to join once OUT/admit exists
    intruder = elastic_jobs.join(address, "--token", "not-the-token", name="intruder", cwd=elsewhere)
    joiner = elastic_jobs.join(address, "--token-file", str(token_file), name="j1", cwd=elsewhere)
    try:
        # the members wait at step 10, past the boundary after round 1 (step 5) which must not admit anyone
        _wait("the members at the gate", elastic_jobs.at_gate(out, ["w0", "w1"]), proc, err)
        (out / "admit").write_text("")
        _wait("the joiner to be ready", elastic_jobs.has_key(address, "ready/j1"), proc, err)
        (out / "go").write_text("")  # the next boundary (after round 2, step 10) admits the ready joiner
        joined_out = joiner.communicate(timeout=TIMEOUT)[0]
        refused_out = intruder.communicate(timeout=TIMEOUT)[0]
        log = elastic_jobs.finish(proc, err, TIMEOUT)
    finally:
        for p in (joiner, intruder, proc):
            if p.poll() is None:
                p.kill()
        elastic_jobs.kill_job_processes(f"{tmp_path}/")  # the joiner's script, when the test failed early
    assert proc.returncode == 0, log + _logs(tmp_path)
    assert joiner.returncode == 0, joined_out

    assert intruder.returncode == REFUSED_EXIT_CODE, refused_out
    assert f"islands: join refused by {address}: wrong token" in refused_out
    token = token_file.read_text().strip()
    assert "refused 'intruder'" in log and token not in log + refused_out + joined_out

    members = {n: json.loads((out / f"{n}.json").read_text()) for n in ("w0", "w1")}
    j1 = json.loads((out / "j1.json").read_text())
    # it entered at the round boundary, and its Checkpointer loaded nothing older (saves were at 3, 6, 9)
    assert j1["start"] == j1["start_step"] == 10
    entered = next(e for e in j1["events"] if e["type"] == "entered")
    joins = [next(e for e in r["events"] if e["type"] == "join") for r in members.values()]
    assert {(e["round"], e["step"], e["global_sha256"]) for e in joins} == {(2, 10, entered["global_sha256"])}
    assert entered["step"] == 10 and entered["round"] == 2
    # it was in every round from the next one on, and everyone ends with the same global model
    assert j1["rounds"] == [3, 3, 3, 3] and all(r["rounds"] == [2, 2, 3, 3, 3, 3] for r in members.values())
    assert len({r["sha"] for r in members.values()} | {j1["sha"]}) == 1 and j1["size"] == 3
    # its checkpoint parts went to the job's directory: the last save holds all three members' parts
    ckpt = CheckpointStore(tmp_path / "ckpt", clean=False)
    assert ckpt.latest_step() == 30 and ckpt.verify(30) == []
    assert ckpt.load(30, rank=2).tree["world"]["size"] == 3


def test_a_script_without_an_outer_strategy_fails_with_a_clear_message(tmp_path):
    # one worker is enough; a fresh interpreter, as a script's workers start by default
    proc, err = elastic_jobs.start_job(tmp_path, SCRIPT, 1, "--out", "out", "--no-outer", preload="")
    log = elastic_jobs.finish(proc, err, TIMEOUT)
    assert proc.returncode == 1
    assert "every worker failed" in log and "an elastic job needs an outer strategy" in log
    assert "islands.outer.DiLoCo" in log  # and what would be right


def test_an_outer_strategy_used_alone_holds_the_membership_and_a_joiner_starts_at_the_members_step(tmp_path):
    """In one process, two threads: a member and a joiner, each with its own World, a bare DiLoCo (no Stack)
    and a Checkpointer. The joiner's wrap returns at the members' step with their global model; its
    Checkpointer's restore returns that step although older checkpoints are on disk."""
    import threading

    import torch
    import torch.nn.functional as F

    from islands import Checkpointer, close_world
    from islands.outer import DiLoCo, OuterSGD
    from islands.runtime.elastic import global_digest
    from islands.runtime.elastic.membership import Coordinator, JobSpec, host_store
    from islands.runtime.world import join_elastic

    server, store = host_store(0)
    coord = Coordinator(store, "tok", JobSpec(workers=1, heartbeat_timeout=5.0, timeout=30.0), log=lambda _: None)
    coord.start()
    address, steps = f"127.0.0.1:{server.port}", 12
    data = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=data), torch.randint(0, 3, (8,), generator=data)) for _ in range(steps)]
    results: dict[str, dict] = {}

    def train(name: str, before_step=lambda step: None) -> None:
        world = join_elastic(address, name, "tok")
        torch.manual_seed(0 if name == "w0" else 7)  # the joiner's own initial model must not matter
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        strategy = DiLoCo(2, outer_optimizer=OuterSGD(1.0, 0.0))
        model = strategy.wrap(model, opt, world)
        assert world.membership.holder is strategy
        ckpt = Checkpointer(tmp_path / "ckpt", world, every=4, asynchronous=False)
        start = ckpt.restore(model=model, optimizer=opt, strategy=strategy) or 0
        results[name] = {
            "start": start,
            "start_step": world.start_step,
            "entered_sha": global_digest(strategy.global_model),
        }
        for step in range(start, steps):
            before_step(step)
            x, y = batches[step]
            F.cross_entropy(model(x), y).backward()
            strategy.after_backward(model, step)
            opt.step()
            opt.zero_grad()
            strategy.after_step(model, opt, step)
            ckpt.maybe_save(step + 1, model=model, optimizer=opt, strategy=strategy)
        strategy.finish(model)
        ckpt.close()
        results[name].update(
            sha=global_digest(strategy.global_model), events=world.membership.state_dict()["events"], size=world.size
        )
        close_world(world)

    errors: list[BaseException] = []

    def run(name: str, **hooks) -> None:
        try:
            train(name, **hooks)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    thread = threading.Thread(target=run, args=("j1",), daemon=True)

    def start_joiner(step: int) -> None:
        """The member trains alone for 6 steps (3 rounds, a checkpoint at step 4), then starts the joiner and
        waits until it is ready (in its wrap): the boundary after round 3, at step 6, admits it."""
        if step != 6:
            return
        thread.start()
        deadline = time.monotonic() + 60
        while not store.check(["ready/j1"]):
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.01)

    try:
        first = threading.Thread(target=run, args=("w0",), kwargs={"before_step": start_joiner}, daemon=True)
        first.start()
        first.join(120)
        thread.join(120)
    finally:
        coord.stop()
    assert not errors, errors
    w0, j1 = results["w0"], results["j1"]
    join = next(e for e in w0["events"] if e["type"] == "join")
    assert j1["start"] == j1["start_step"] == join["step"] == 6 and join["round"] == 3  # not the checkpoint of step 4
    assert j1["entered_sha"] == join["global_sha256"]  # it holds the members' global model after its wrap
    assert w0["sha"] == j1["sha"] and w0["size"] == j1["size"] == 2


def test_a_script_job_of_two_worker_islands_loses_a_follower_and_its_restarted_island_rejoins(tmp_path):
    """`islands run --elastic --workers 4 --islands 2 --max-restarts 1`: the script's own loop with DDP inside each
    island (its local group) and DiLoCo across. A follower SIGKILLed mid-run takes island 1 out; the launcher
    restarts it, it enters with the global state, and all four final workers agree bitwise; `islands join`
    (one worker) is refused by such a job."""
    out = tmp_path / "out"
    proc, err = elastic_jobs.start_job(
        tmp_path,
        SCRIPT,
        4,
        "--out",
        "out",
        "--steps",
        "40",
        "--gate",
        "10",
        "--hold-at",
        "20",
        launcher_args=("--islands", "2", "--max-restarts", "1"),
    )
    names = ["i0w0", "i0w1", "i1w0", "i1w1"]
    _wait("every worker at the gate", elastic_jobs.at_gate(out, names), proc, err)
    address = elastic_jobs.address(err)
    lone = elastic_jobs.join(address, "--token-file", str(tmp_path / "run" / "token"), name="j9", cwd=tmp_path)
    assert lone.wait(TIMEOUT) == REFUSED_EXIT_CODE
    assert "islands have 2 workers each" in lone.stdout.read()
    os.kill(int((out / "pid-i1w1").read_text()), signal.SIGKILL)  # a follower: its island leaves as a whole
    (out / "go").write_text("")
    _wait("the restarted island's leader", elastic_jobs.has_key(address, "ready/i1w0.1"), proc, err)
    (out / "go2").write_text("")
    log = elastic_jobs.finish(proc, err, TIMEOUT)
    assert proc.returncode == 0, log + _logs(tmp_path)
    assert "island 1 left the job" in log and "restarting island 1 (restart 1 of 1) as i1w0.1, i1w1.1" in log, log
    final = ["i0w0", "i0w1", "i1w0.1", "i1w1.1"]
    recs = {n: json.loads((out / f"{n}.json").read_text()) for n in final}
    assert not (out / "i1w0.json").exists() and not (out / "i1w1.json").exists()
    assert len({r["sha"] for r in recs.values()}) == 1, {n: r["sha"] for n, r in recs.items()}
    for n, r in recs.items():
        assert r["size"] == 4 and r["islands"] == 2, (n, r)  # two islands of two workers at the end
    joined = [e for e in recs["i0w0"]["events"] if e["type"] == "join"]
    assert joined and joined[-1]["joined"] == ["i1w0.1"]
    assert recs["i1w0.1"]["start_step"] == recs["i1w1.1"]["start_step"] > 10  # entered mid-run, the follower too


def test_elastic_run_flags_that_cannot_work_are_refused_before_anything_starts(tmp_path, capsys):
    import pytest

    from islands.cli import main

    (tmp_path / "job.py").write_text(SCRIPT)
    cases = [
        (["--heartbeat-timeout", "5"], "apply to elastic jobs only; add --elastic"),
        (["--elastic", "--islands", "2", "--workers", "3"], "does not divide --workers 3"),
        (["--max-restarts", "2"], "apply to elastic jobs only"),
        (["--elastic", "--testbed", "nosuchbed"], "no testbed named 'nosuchbed'"),
        (["--elastic", "--heartbeat-timeout", "0"], "--heartbeat-timeout must be > 0 seconds"),
        (["--preload", "transformer"], "--preload: no package 'transformer' is installed"),
        (["--preload", "json,os.path,3d"], "--preload: '3d' is not a module name"),
    ]
    for flags, needle in cases:
        with pytest.raises(SystemExit) as exited:
            main(["run", *flags, "--run-dir", str(tmp_path / "run"), str(tmp_path / "job.py")])
        assert exited.value.code == 2, flags
        assert needle in capsys.readouterr().err, flags
    assert not (tmp_path / "run").exists()
