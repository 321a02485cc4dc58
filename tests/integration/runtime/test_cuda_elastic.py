"""An elastic job on one GPU (issue #34 items 4 and 6), skipped without one: three islands of one worker share the
device (an elastic job's cross group is gloo, which does not mind, where NCCL refuses two ranks on one GPU), train
a model on CUDA with DiLoCo, lose one worker to SIGKILL mid-run and finish; a worker started with `islands join`
enters at a round boundary with the members' CUDA state and ends with their global model, bit for bit."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

import harness.elastic as elastic_jobs

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TIMEOUT = 240

# The own-loop program on the device `--device` names; gates as tests/integration/elastic/test_run_elastic.py's.
SCRIPT = r"""
import argparse, json, os, time
from pathlib import Path
import torch, torch.nn as nn, torch.nn.functional as F
import islands
from islands.runtime.elastic import global_digest

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--device", default="cuda")
p.add_argument("--steps", type=int, default=40)
p.add_argument("--gate", type=int, default=10)
args = p.parse_args()
out, name = Path(args.out), os.environ["ISLANDS_NAME"]
out.mkdir(parents=True, exist_ok=True)
(out / f"pid-{name}").write_text(str(os.getpid()))
deadline = time.monotonic() + 200
while name.startswith("j") and not (out / "admit").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
world = islands.init_world(device=args.device)
g = torch.Generator().manual_seed(0)
X = torch.randn(1200, 64, generator=g).to(world.device)
Y = (X.cpu() @ torch.randn(64, 10, generator=g)).argmax(-1).to(world.device)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).to(world.device)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
strategy = islands.Stack(outer=islands.outer.DiLoCo(inner_steps=5))
model = strategy.wrap(model, opt, world)
shard, shards = world.shard
for step in range(world.start_step, args.steps):
    i = (step * 16) % 300
    x, y = X[shard::shards][i:i + 16], Y[shard::shards][i:i + 16]
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
    "device": str(next(model.parameters()).device), "cross": type(world.comm("cross")).__name__,
    "start_step": world.start_step, "sha": global_digest(strategy.eval_model(model)),
    "failures": [e["gone"] for e in m.state_dict()["events"] if e["type"] == "failure"]}))
islands.close_world(world)
"""


def test_an_elastic_job_on_one_gpu_loses_a_worker_and_admits_a_joiner(tmp_path):
    out = tmp_path / "out"
    proc, err = elastic_jobs.start_job(tmp_path, SCRIPT, 3, "--out", "out")
    elastic_jobs.wait(
        elastic_jobs.at_gate(out, ["w0", "w1", "w2"]), "every worker at the gate", TIMEOUT, proc=proc, log=err
    )
    os.kill(int((out / "pid-w2").read_text()), signal.SIGKILL)
    address = elastic_jobs.address(err)
    assert address is not None
    joiner = elastic_jobs.join(address, "--token-file", str(tmp_path / "run" / "token"), name="j1", cwd=tmp_path)
    (out / "admit").write_text("")
    elastic_jobs.wait(elastic_jobs.has_key(address, "ready/j1"), "the joiner ready", TIMEOUT, proc=proc, log=err)
    (out / "go").write_text("")
    log = elastic_jobs.finish(proc, err, TIMEOUT)
    joined = joiner.communicate(timeout=TIMEOUT)[0]
    assert proc.returncode == 0, log + elastic_jobs.logs(tmp_path / "run")
    assert joiner.returncode == 0, joined
    recs = {n: json.loads((out / f"{n}.json").read_text()) for n in ("w0", "w1", "j1")}
    assert {r["device"] for r in recs.values()} == {"cuda:0"}
    assert {r["cross"] for r in recs.values()} == {"StagedElasticComm"}
    assert len({r["sha"] for r in recs.values()}) == 1  # the joiner ends with the members' global model
    assert recs["j1"]["start_step"] >= 10  # entered at a round boundary at or after the gate
    assert recs["w0"]["failures"] == [["w2"]] == recs["w1"]["failures"]
