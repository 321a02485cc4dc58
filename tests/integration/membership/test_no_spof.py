"""No single point of failure (issue #20 item 2), step 1: a SIGKILLed launcher does not take the job with it.

The store and the coordinator live in the job host (islands.runtime.launch.job_host), a detached process; the
workers run in sessions of their own. SIGKILL the launcher of `islands train --elastic` mid-run: the workers
finish every step and agree bitwise, rank 0 of the last epoch writes run.json, the job host writes its
record and ends by itself, and no process of the job is left. A worker SIGKILLed after the launcher died is
found by its heartbeat alone (no launcher to flag it) and the others finish without it."""

from __future__ import annotations

import base64
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

import harness.elastic as elastic_jobs
import islands.testbed.etcd as etcd_cluster
from harness.elastic import job_processes as _job_processes, logs as _logs
from islands.runtime.elastic.etcd_store import ENDED_KEY, EtcdAddress, EtcdClient, leader_key
from islands.runtime.elastic.membership import connect, parse_address

HEARTBEAT = 5.0  # seconds: the job's heartbeat timeout (generous: the test machine is shared and loaded)


def _wait(cond, what: str, timeout: float = 120.0, log: Path | None = None):
    return elastic_jobs.wait(cond, what, timeout, log=log)


def _record(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _train(tmp_path: Path, steps: int, workers: int, islands: int | None = None) -> tuple[subprocess.Popen, Path, Path]:
    run = tmp_path / "run"
    err = tmp_path / "launcher.err"
    with open(err, "w") as stderr:  # the child writes through its own copy of the descriptor
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "islands",
                "train",
                "--task",
                "digits",
                "--workers",
                str(workers),
                "--islands",
                str(islands or workers),
                *(["--inner", "ddp"] if islands else []),
                "--outer",
                "local-sgd:every=3",
                "--elastic",
                "--steps",
                str(steps),
                "--global-batch",
                "24",
                "--eval-every",
                "0",
                "--warmup",
                "2",
                "--no-probe",
                "--no-progress",
                "--timeout",
                "30",
                "--heartbeat-timeout",
                str(HEARTBEAT),
                "--run-dir",
                str(run),
            ],
            cwd=tmp_path,
            env=elastic_jobs.env(),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    return proc, run, err


def _kill_launcher_mid_run(tmp_path: Path, steps: int, kill_a_worker: bool) -> tuple[Path, dict, str]:
    # two workers show the job going on without its launcher; killing one of three leaves two to agree
    proc, run, err = _train(tmp_path, steps, workers=3 if kill_a_worker else 2)
    try:
        host = _wait(lambda: _record(run / "job_host.json"), "the job host", log=err)
        h, p = parse_address(host["address"])
        store = connect(h, p)
        _wait(partial(store.check, ["round/4/join"]), "four rounds", log=err)
        assert proc.poll() is None, err.read_text()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed_at = time.time()
        if kill_a_worker:  # after the launcher: nobody sets its dead flag, its heartbeat must tell
            _wait(partial(store.check, ["round/6/join"]), "two more rounds", log=run / "logs" / "w0.log")
            victim = elastic_jobs.worker_pid(run, "w2")
            os.kill(victim, signal.SIGKILL)
        del store
        ended = _wait(
            lambda: (r := _record(run / "job_host.json")) and "ended" in r and r,
            "the job host's end",
            timeout=150,
            log=run / "logs" / "w0.log",
        )
        _wait(lambda: not _job_processes(str(run)), "every process of the job to exit", timeout=30)
        return run, ended, killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
        elastic_jobs.kill_job_processes(str(run))  # never leave a process behind, even when the test failed


def test_a_sigkilled_launcher_leaves_the_workers_training_and_the_record_is_written(tmp_path):
    steps = 45
    run, ended, killed_at = _kill_launcher_mid_run(tmp_path, steps, kill_a_worker=False)
    logs = _logs(run)
    assert ended["launcher_alive"] is False and ended["why"] == "no member of the newest epoch is alive", ended
    assert ended["admitted"] == 2
    recs = elastic_jobs.records(run)
    assert set(recs) == {"w0", "w1"}, logs
    assert len({r["global_sha256"] for r in recs.values()}) == 1, "the workers disagree on the global model"
    for r in recs.values():
        assert not [e for e in r["final"]["events"] if e["type"] == "failure"], r["final"]["events"]
    rec = json.loads((run / "run.json").read_text())  # written by rank 0 (a worker), whole (os.replace)
    assert rec["summary"]["steps"] == steps and rec["summary"]["workers"] == 2, rec["summary"]
    assert not list(run.glob("*.tmp*")) and not list(run.glob(".*.tmp*"))
    elastic_jobs.assert_nothing_half_written(run)
    assert ended["ended"] > killed_at
    assert "job host: the launcher" in (run / "logs" / "job_host.log").read_text()


def test_after_the_launcher_died_a_killed_worker_is_found_by_its_heartbeat_and_the_others_finish(tmp_path):
    steps = 60
    run, ended, _ = _kill_launcher_mid_run(tmp_path, steps, kill_a_worker=True)
    logs = _logs(run)
    assert ended["why"] == "no member of the newest epoch is alive", ended
    recs = elastic_jobs.records(run)
    assert set(recs) == {"w0", "w1"}, logs
    assert len({r["global_sha256"] for r in recs.values()}) == 1
    for r in recs.values():
        failures = [e for e in r["final"]["events"] if e["type"] == "failure"]
        assert len(failures) == 1 and failures[0]["gone"] == ["w2"], failures
    rec = json.loads((run / "run.json").read_text())
    assert rec["summary"]["steps"] == steps and rec["summary"]["workers"] == 2, rec["summary"]
    elastic_jobs.assert_nothing_half_written(run)


def test_after_the_launcher_died_a_frozen_follower_takes_its_island_out_within_the_heartbeat_timeout(tmp_path):
    # 2 islands of 2 workers; with no launcher to find the stopped follower, its leader's FollowerWatch must: the
    # leader's heartbeat beats on while it waits in the island's all-reduce, so without the watch the other island
    # would wait for the 30 s collective timeout (and the leader for minutes)
    proc, run, err = _train(tmp_path, 90, workers=4, islands=2)
    frozen = None
    try:
        host = _wait(lambda: _record(run / "job_host.json"), "the job host", log=err)
        h, p = parse_address(host["address"])
        store = connect(h, p)
        _wait(partial(store.check, ["round/4/join"]), "four rounds", log=err)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        _wait(partial(store.check, ["round/6/join"]), "two more rounds", log=run / "logs" / "i0w0.log")
        frozen = elastic_jobs.worker_pid(run, "i1w1")
        os.kill(frozen, signal.SIGSTOP)
        stopped = time.time()
        del store
        ended = _wait(
            lambda: (r := _record(run / "job_host.json")) and "ended" in r and r,
            "the job host's end",
            timeout=150,
            log=run / "logs" / "i0w0.log",
        )
        # everything of the job but the stopped process exits by itself (the leader within its grace)
        _wait(
            lambda: [p for p in _job_processes(str(run)) if p != frozen] == [],
            "the job's other processes to exit",
            timeout=30,
        )
    finally:
        if frozen is not None:
            os.kill(frozen, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
        elastic_jobs.kill_job_processes(str(run))
    logs = _logs(run)
    assert ended["why"] == "no member of the newest epoch is alive", ended
    recs = elastic_jobs.records(run)
    assert set(recs) == {"i0w0", "i0w1"}, logs
    assert len({r["global_sha256"] for r in recs.values()}) == 1
    failure = next(e for e in recs["i0w0"]["final"]["events"] if e["type"] == "failure")
    assert failure["gone"] == ["i1w0"], failure
    # found through the leader's watch of its follower: the heartbeat timeout and polling, not the 30 s timeout
    assert failure["detected"] - stopped < HEARTBEAT + 3.0, (failure["detected"] - stopped, logs)
    assert "its follower i1w1 is silent" in (run / "logs" / "i1w0.log").read_text(), logs
    elastic_jobs.assert_nothing_half_written(run)


# ---- over etcd: no process the job cannot lose ------------------------------------------------------
# The own-loop program (docs/own-model.md) with a tiny MLP. Test hooks: --gate STEP makes every member write
# OUT/gate-NAME there and wait for OUT/go; each member records its commits' end times (stall measurement); a
# joiner (a name starting with "j", started early so that its start-up overlaps the job's) asks to join only
# once OUT/admit exists.
SCRIPT = r"""
import argparse, json, os, time
from pathlib import Path
import torch, torch.nn as nn, torch.nn.functional as F
import islands
from islands.runtime.elastic import global_digest

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--gate", type=int, default=-1)
args = p.parse_args()
out, name = Path(args.out), os.environ["ISLANDS_NAME"]
out.mkdir(parents=True, exist_ok=True)
(out / f"pid-{name}").write_text(str(os.getpid()))
g = torch.Generator().manual_seed(0)
X = torch.randn(600, 16, generator=g)
Y = (X @ torch.randn(16, 4, generator=g)).argmax(-1)
torch.manual_seed(0)
deadline = time.monotonic() + 200
while name.startswith("j") and not (out / "admit").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
world = islands.init_world()
model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
strategy = islands.Stack(outer=islands.outer.DiLoCo(inner_steps=3))
model = strategy.wrap(model, opt, world)
shard, shards = world.shard
for step in range(world.start_step, args.steps):
    x, y = X[shard::shards][step * 8 % 160:][:8], Y[shard::shards][step * 8 % 160:][:8]
    F.cross_entropy(model(x), y).backward()
    strategy.after_backward(model, step)
    opt.step(); opt.zero_grad()
    strategy.after_step(model, opt, step)
    if step + 1 == args.gate:
        (out / f"gate-{name}").write_text("")
        deadline = time.monotonic() + 200
        while not (out / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
strategy.finish(model)
m = world.membership
(out / f"{name}.json").write_text(json.dumps({
    "start": world.start_step, "size": world.size, "sha": global_digest(strategy.eval_model(model)),
    "events": m.state_dict()["events"],
    "commits": [[s["start"] + s["seconds"], s["size"]] for s in m.syncs if s["kind"] == "outer_delta"]}))
islands.close_world(world)
"""


@pytest.fixture
def etcd():
    if not etcd_cluster.available():
        pytest.skip("etcd-server is not installed (apt-get install etcd-server)")
    c = etcd_cluster.EtcdCluster(3).start()
    yield c
    c.stop()


def _script_job(tmp_path: Path, url: str, *args: str) -> tuple[subprocess.Popen, Path]:
    # two workers: enough to agree bitwise, and for a standby coordinator among them
    return elastic_jobs.start_job(tmp_path, SCRIPT, 2, *args, store_url=url, heartbeat=HEARTBEAT)


def _finish(proc: subprocess.Popen, err: Path, where: Path) -> str:
    """Wait for the launcher; then no process naming `where` (the test's directory: job host, workers) is left."""
    try:
        return elastic_jobs.finish(proc, err, timeout=180)
    finally:
        elastic_jobs.kill_job_processes(f"{where}/")


def test_over_etcd_the_job_survives_a_sigkilled_etcd_member(tmp_path, etcd):
    out = tmp_path / "out"
    proc, err = _script_job(tmp_path, etcd.url, "--out", "out", "--steps", "24", "--gate", "9")
    try:
        _wait(elastic_jobs.at_gate(out, ["w0", "w1"]), "every worker at the gate", log=err)
        assert elastic_jobs.address(err).startswith(etcd.url + "/islands-")  # the job's own namespace in the cluster
        etcd.kill(0)  # the member every client tries first
        (out / "go").write_text("")
    finally:
        log = _finish(proc, err, tmp_path)
    assert proc.returncode == 0, log + _logs(tmp_path / "run")
    recs = elastic_jobs.outputs(out, ["w0", "w1"])
    assert len({r["sha"] for r in recs.values()}) == 1, "the workers disagree on the global model"
    for r in recs.values():
        assert not [e for e in r["events"] if e["type"] == "failure"] and len(r["commits"]) == 8
    elastic_jobs.assert_nothing_half_written(tmp_path / "run")


def test_over_etcd_the_coordinators_death_loses_nothing_and_a_joiner_is_admitted_by_a_standby(tmp_path, etcd):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc, err = _script_job(tmp_path, etcd.url, "--out", "out", "--steps", "36", "--gate", "18")
    run = tmp_path / "run"
    joiner = None
    try:
        address = _wait(lambda: elastic_jobs.address(err), "the job's address", log=err)
        # started now, so that its start-up overlaps the job's; its script asks to join once OUT/admit exists
        joiner = elastic_jobs.join(address, "--token-file", str(run / "token"), name="j1", cwd=elsewhere)
        ns = address.rsplit("/", 1)[1]
        client = EtcdClient(EtcdAddress.parse(etcd.url).endpoints)
        key = leader_key(f"{ns}/".encode())
        _wait(lambda: client.get(key) == b"job-host", "the job host to lead", log=err)
        store = connect(*parse_address(address))
        _wait(lambda: store.check(["round/2/join"]), "two rounds", log=err)
        host = json.loads((run / "job_host.json").read_text())
        os.kill(host["pid"], signal.SIGKILL)  # the store's client and the coordinator's lease holder, mid-run
        killed = time.time()
        took_over = _wait(
            lambda: (h := client.get(key)) not in (None, b"job-host") and h, "a standby to lead", timeout=30, log=err
        )
        takeover_s = time.time() - killed
        assert took_over.decode() in ("w0", "w1")
        (out / "admit").write_text("")
        _wait(lambda: store.check(["ready/j1"]), "the joiner admitted by the new coordinator and ready", log=err)
        _wait(elastic_jobs.at_gate(out, ["w0", "w1"]), "every worker at the gate", log=err)
        (out / "go").write_text("")
        joined = joiner.communicate(timeout=180)[0]
    finally:
        if joiner is not None and joiner.poll() is None:
            joiner.kill()
        log = _finish(proc, err, tmp_path)
    assert proc.returncode == 0, log + _logs(run)
    assert joiner.returncode == 0, joined
    # the dead job host never ended the job: the launcher did, and the cluster keeps only the end mark
    assert "the launcher marked the job ended in etcd and removed its keys" in log, log
    left = [base64.b64decode(kv["key"]) for kv in client.range(f"{ns}/".encode(), prefix=True).get("kvs", [])]
    assert left == [f"{ns}/{ENDED_KEY}".encode()], left
    recs = elastic_jobs.outputs(out, ["w0", "w1", "j1"])
    assert len({r["sha"] for r in recs.values()}) == 1, "the members disagree on the global model"
    elastic_jobs.assert_nothing_half_written(run)
    assert recs["j1"]["start"] == 18 and recs["j1"]["size"] == 3
    for n in ("w0", "w1"):
        assert not [e for e in recs[n]["events"] if e["type"] == "failure"]  # nobody died: nothing to re-form
        assert len(recs[n]["commits"]) == 12
    # the survivors' stall: on w0's clock, its longest gap between commits from the kill to the gate (where it
    # waits on purpose), against its usual gap before the kill
    gate = min((out / f"gate-{n}").stat().st_mtime for n in ("w0", "w1"))
    commits = [t for t, _ in recs["w0"]["commits"]]
    gaps = list(itertools.pairwise(commits))
    usual = sorted(b - a for a, b in gaps if b < killed)
    after = [b - a for a, b in gaps if b >= killed and b <= gate]
    assert after, "no round committed between the kill and the gate"
    base = usual[len(usual) // 2] if usual else min(after)
    stall = max(after) - base
    print(
        f"coordinator takeover {takeover_s:.2f} s after SIGKILL; survivors' stall {stall:.2f} s "
        f"(usual round {base:.2f} s)"
    )
    # training never waits on the coordinator (it admits joiners, nothing else); the bound is loose for a loaded
    # machine (measured 0.93 s over a 0.83 s round at load average 18), the goal is 2 s
    assert stall < 5.0
    assert takeover_s < 15


def test_a_coordinator_whose_poll_outlasts_the_lease_ttl_keeps_the_lease(etcd, monkeypatch):
    """The lease is kept alive on a thread of its own. When the keep-alive waited behind the poll, a poll longer
    than the TTL (a new leader re-reading ~90 tickets on a loaded machine, chaos run 8) let the lease lapse
    before each poll ended: the seat took and lost the lead over and over and answered no joiner."""
    from islands.runtime.elastic import membership

    polls: list[float] = []

    def slow_poll(self):
        polls.append(time.monotonic())
        time.sleep(membership.LEASE_TTL_S * 1.5)

    monkeypatch.setattr(membership.Coordinator, "poll", slow_poll)
    job = membership.JobSpec(workers=2, heartbeat_timeout=1.5, timeout=30.0, job_id="seat-test")
    seat = membership.CoordinatorSeat(f"{etcd.url}/islands-seat-test", "token", job, "w0", log=lambda line: None)
    seat.start()
    try:
        deadline = time.monotonic() + 30
        while len(polls) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(polls) >= 4, "the seat never led"
        # four polls of 1.5 TTL each, one term throughout, and the key still names this seat
        assert len(seat.terms) == 1 and "until" not in seat.terms[0], seat.terms
        assert seat.leading and seat.leader() == "w0"
    finally:
        seat.stop()
