"""Failures that are not crashes, on gloo with tiny jobs and short timeouts (issue #20 item 3): a worker frozen
with SIGSTOP and a worker whose main thread hangs while its heartbeat still beats (a collective that times
out). Each is detected within its timeout, the survivors finish and agree, and the launcher does not wait on
the process the job gave up on: it kills it and exits with the survivors' code, run records written."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time

import harness.elastic as elastic_jobs
from harness.elastic import elastic_config
from islands.app.launch import launch_elastic
from islands.runtime.elastic.membership import connect
from islands.runtime.launch.elastic import launch_elastic_script

HEARTBEAT = 2.0  # seconds: the heartbeat timeout of these jobs


def _in_thread(fn, errors: list):
    def body(*args):
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - surfaced by the test after the job
            errors.append(e)

    return body


def test_a_frozen_worker_is_excluded_within_the_heartbeat_timeout_and_killed_by_the_launcher(tmp_path):
    cfg = elastic_config(
        workers=3,
        islands=3,
        outer="local-sgd:every=3",
        steps=60,
        global_batch=24,
        warmup=2,
        heartbeat_timeout=HEARTBEAT,
        run_dir=str(tmp_path / "run"),
    )
    seen: dict = {}
    errors: list = []
    frozen: list = []

    def freeze(address, workers):
        host, port = address.split(":")
        store = connect(host, int(port))
        elastic_jobs.wait(lambda: store.check(["round/4/join"]), "four rounds", 120)
        victim = workers[2]
        os.kill(victim.proc.pid, signal.SIGSTOP)  # frozen, not dead: no exit for the launcher to see
        frozen.append(victim.proc)
        seen["stopped"] = time.time()

    out = io.StringIO()
    try:
        code = launch_elastic(
            cfg,
            tmp_path / "run",
            out=out,
            on_started=lambda a, w, c: threading.Thread(
                target=_in_thread(freeze, errors), args=(a, w), daemon=True
            ).start(),
        )
        finished = time.time()
    finally:
        for proc in frozen:  # never leave a stopped process behind
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
    assert not errors, errors
    log = out.getvalue()
    assert code == 0, log
    assert frozen and frozen[0].returncode == -signal.SIGKILL, log  # the launcher killed it; it did not hang
    assert "worker w2: no heartbeat for" in log and "w2 left (killed by SIGKILL)" in log, log
    recs = elastic_jobs.records(tmp_path / "run")
    assert set(recs) == {"w0", "w1"}
    assert len({r["global_sha256"] for r in recs.values()}) == 1
    elastic_jobs.assert_nothing_half_written(tmp_path / "run")
    for r in recs.values():
        failure = next(e for e in r["final"]["events"] if e["type"] == "failure")
        assert failure["gone"] == ["w2"]
        # detected within the heartbeat timeout (plus polling and a loaded machine's slack), not the 30 s timeout
        assert failure["detected"] - seen["stopped"] < HEARTBEAT + 3.0, failure["detected"] - seen["stopped"]
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["summary"]["steps"] == 60 and run["summary"]["workers"] == 2
    assert finished - seen["stopped"] < 60  # nothing waited on the frozen process


# A digits-sized MLP on synthetic data, the own-loop program; --hang NAME:STEP makes that worker's main thread
# sleep forever at STEP while its heartbeat thread keeps beating (alive but stuck: only a timeout can tell).
SCRIPT = r"""
import argparse, json, os, time
from pathlib import Path
import torch, torch.nn as nn, torch.nn.functional as F
import islands
from islands.runtime.elastic import global_digest

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--hang", default="")
args = p.parse_args()
out, name = Path(args.out), os.environ["ISLANDS_NAME"]
out.mkdir(parents=True, exist_ok=True)
hang_name, _, hang_step = args.hang.partition(":")
g = torch.Generator().manual_seed(0)
X = torch.randn(600, 16, generator=g)
Y = (X @ torch.randn(16, 4, generator=g)).argmax(-1)
torch.manual_seed(0)
world = islands.init_world()
model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
strategy = islands.Stack(outer=islands.outer.DiLoCo(inner_steps=2))
model = strategy.wrap(model, opt, world)
shard, shards = world.shard
for step in range(world.start_step, 24):
    if name == hang_name and step == int(hang_step):
        (out / f"hung-{name}").write_text(str(time.time()))
        while True:
            time.sleep(1)
    x, y = X[shard::shards][step * 8 % 160:][:8], Y[shard::shards][step * 8 % 160:][:8]
    F.cross_entropy(model(x), y).backward()
    strategy.after_backward(model, step)
    opt.step(); opt.zero_grad()
    strategy.after_step(model, opt, step)
strategy.finish(model)
m = world.membership
(out / f"{name}.json").write_text(json.dumps({"sha": global_digest(strategy.eval_model(model)),
                                               "events": m.state_dict()["events"], "size": world.size}))
islands.close_world(world)
"""


def test_a_collective_that_times_out_is_detected_and_the_stuck_worker_is_excluded_then_killed(tmp_path, monkeypatch):
    (tmp_path / "job.py").write_text(SCRIPT)
    out_dir = tmp_path / "out"
    monkeypatch.delenv("ISLANDS_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)
    log = io.StringIO()
    timeout = 3.0  # the collective timeout: the only thing that can tell a live but stuck member
    started = time.time()
    code = launch_elastic_script(
        [str(tmp_path / "job.py"), "--out", str(out_dir), "--hang", "w2:9"],
        3,
        tmp_path / "run",
        heartbeat_timeout=HEARTBEAT,
        timeout=timeout,
        out=log,
    )
    took = time.time() - started
    text = log.getvalue()
    assert code == 0, text
    assert "worker w2: excluded from epoch 1 by the members and still running" in text, text
    elastic_jobs.assert_nothing_half_written(tmp_path / "run")
    recs = {n: json.loads((out_dir / f"{n}.json").read_text()) for n in ("w0", "w1")}
    assert not (out_dir / "w2.json").exists()
    assert len({r["sha"] for r in recs.values()}) == 1 and {r["size"] for r in recs.values()} == {2}
    hung = float((out_dir / "hung-w2").read_text())
    for r in recs.values():
        failure = next(e for e in r["events"] if e["type"] == "failure")
        assert failure["gone"] == ["w2"]
        # the exchange waits one collective timeout, the new epoch up to one more for w2 to register
        assert failure["detected"] - hung < timeout + 3.0
        assert failure["formed"] - failure["detected"] < timeout + 3.0
    assert took < 120, took
