"""Outer strategies with exchanges in flight across steps, and gossip, under churn (issue #20 item 4), on gloo.

Each job is the own-loop program (docs/own-model.md) run by `islands run --elastic`: streaming DiLoCo (F=2, tau=2,
4-bit deltas), DiLoCo with tau=1, overlap local SGD (tau=3) and gossip (exp graph; random:s=1 with push-sum). A
member that SIGKILLs itself while an exchange is in flight on the others' exchange threads (gossip: between rounds)
is dropped; the survivors fail the exchange over, land every round exactly once and commit every exchange in the
same epochs. A worker started with `islands join` then enters at the boundary after a landing (streaming and
overlap: with an exchange in flight, whose result it receives) and ends with the members' global model, bit for bit;
everyone exits 0. Gossip has no global model: there the two survivors, which mix with each other every round on the
exp graph, hold equal models at the join only if both planned the same graph after the failure. One job per strategy
does both (kill, then join): process start-up dominates on a loaded machine."""

from __future__ import annotations

import io
import json
import threading

import pytest

import harness.elastic as elastic_jobs
from islands.runtime.launch import spawn
from islands.runtime.launch.elastic import launch_elastic_script

TIMEOUT = 400  # seconds per wait: process start-up on a loaded 2-core machine takes minutes
STEPS = 24

# --die NAME:STEP: that worker SIGKILLs itself right after the strategy's after_step of STEP (streaming and tau=1:
# the step whose exchange just started). --gate STEP: after STEP every member waits for OUT/go (a joiner gets ready).
# A joiner (a name starting with "j") asks to join only once OUT/admit exists: the test starts it early, so that
# its start-up overlaps the job's, and admits it when the survivors are at the gate.
SCRIPT = r"""
import argparse, json, os, signal, time
from pathlib import Path
import torch, torch.nn as nn, torch.nn.functional as F
import islands
from islands.runtime.elastic import global_digest

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--outer", required=True)
p.add_argument("--steps", type=int, default=24)
p.add_argument("--die", default="")
p.add_argument("--gate", type=int, default=-1)
p.add_argument("--authenticate", action="store_true")
p.add_argument("--stage", action="store_true")
args = p.parse_args()
if args.stage:  # every exchanged tensor through host buffers and back, as a CUDA worker's cross exchanges go
    import islands.runtime.staging as staging, islands.runtime.world as world_mod
    world_mod.stages_across = lambda device, cross: True
    staging.needs_staging = lambda tensor: True
out, name = Path(args.out), os.environ["ISLANDS_NAME"]
out.mkdir(parents=True, exist_ok=True)
die_name, _, die_step = args.die.partition(":")
g = torch.Generator().manual_seed(0)
X = torch.randn(960, 16, generator=g)
Y = (X @ torch.randn(16, 4, generator=g)).argmax(-1)
torch.manual_seed(0 if name.startswith("w") else 5)  # a joiner's own start must not matter
deadline = time.monotonic() + 400
while name.startswith("j") and not (out / "admit").exists() and time.monotonic() < deadline:  # asks on cue
    time.sleep(0.05)
world = islands.init_world()
if args.authenticate:  # every payload tagged under the job key (the launcher and islands join set ISLANDS_TOKEN)
    islands.control.authenticate_payloads(world)
model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
outer = {"streaming": lambda: islands.outer.StreamingDiLoCo.from_options(inner_steps=4, fragments=2, tau=2),
         "tau1": lambda: islands.outer.DiLoCo.from_options(inner_steps=5, tau=1),
         "gossip": lambda: islands.outer.Gossip(every=3, topology=islands.outer.ExponentialGraph()),
         "push-sum": lambda: islands.outer.Gossip(every=3, topology=islands.outer.RandomPeers(1, seed=3)),
         "overlap": lambda: islands.outer.OverlapLocalSGD(tau=3)}[args.outer]()
strategy = islands.Stack(outer=outer)
model = strategy.wrap(model, opt, world)
part = getattr(outer, "schedule", outer)  # DiLoCo: its schedule holds the exchanges in flight and sends
pending = getattr(part, "pending", None)
inflight = len(pending) if isinstance(pending, list) else int(pending is not None)
entered = {"start": world.start_step, "inflight": inflight,
           "rounds": outer.rounds, "sha": global_digest(strategy.eval_model(model))}
shard, shards = world.shard
for step in range(world.start_step, args.steps):
    x, y = X[shard::shards][step * 8 % 300:][:8], Y[shard::shards][step * 8 % 300:][:8]
    F.cross_entropy(model(x), y).backward()
    strategy.after_backward(model, step)
    opt.step(); opt.zero_grad()
    strategy.after_step(model, opt, step)
    if name == die_name and step == int(die_step):
        os.kill(os.getpid(), signal.SIGKILL)
    if step + 1 == args.gate:
        (out / f"gate-{name}").write_text("")
        deadline = time.monotonic() + 400
        while not (out / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
strategy.finish(model)
m = world.membership
(out / f"{name}.json").write_text(json.dumps({
    "entered": entered, "sha": global_digest(strategy.eval_model(model)), "events": m.state_dict()["events"],
    "rounds": outer.rounds, "sends": list(getattr(part, "sends", [])), "size": world.size,
    "tagged": m.comm.tags is not None, "cross": type(world.comm("cross")).__name__,
    "syncs": [[s["epoch"], s["size"]] for s in m.syncs if s["kind"] in ("outer_delta", "outer_params")]}))
islands.close_world(world)
"""


def _expected_sends(outer: str) -> list[int]:
    """Sends per fragment of a run of STEPS steps without churn: the schedule's, plus final_sync's one each."""
    from islands.outer import DiLoCo, StreamingDiLoCo

    s = (
        StreamingDiLoCo.from_options(inner_steps=4, fragments=2, tau=2)
        if outer == "streaming"
        else DiLoCo.from_options(inner_steps=5, tau=1)
    ).schedule
    sends = [0] * s.fragments
    for done in range(1, STEPS + 1):
        for p in s.starting(done):
            sends[p] += 1
    return [n + 1 for n in sends]


# +auth: outer.authenticate (tests/integration/auth/test_payload_auth_elastic.py): every tensor of every operation
# tagged, the streaming exchange thread's and gossip's point-to-point rounds included; the retries and the joiner
# tag anew. Streaming and gossip run only with tags: the same churn, the same exchanges, and the tags on top (each
# job is ~20 s of CPU; tau1, push-sum and overlap cover the untagged path).
# +staged: the cross Comm copies every tensor through host buffers and back (runtime.staging.StagedElasticComm), as
# an elastic job on GPUs does (issue #34 item 4): DiLoCo's exchange in flight and push-sum's planned point-to-point
# rounds, with the same churn and the same checks.
@pytest.mark.parametrize(
    "outer, authenticate, staged",
    [
        pytest.param("tau1", False, True, id="tau1+staged"),
        pytest.param("push-sum", False, True, id="push-sum+staged"),
        ("overlap", False, False),
        pytest.param("streaming", True, False, id="streaming+auth"),
        pytest.param("gossip", True, False, id="gossip+auth"),
    ],
)
def test_a_member_killed_mid_exchange_is_dropped_then_a_joiner_enters_and_ends_with_the_members(
    tmp_path, outer, authenticate, staged, monkeypatch
):
    """One job per strategy (process start-up dominates on a loaded machine): 3 workers; w2 SIGKILLs itself after step
    9 (streaming, tau=1: that step just started an exchange; overlap: the average of step 9's boundary is in flight;
    gossip: between rounds); the two
    survivors go on to step 14 and wait there until a worker started with `islands join` is ready; the boundary
    after the next landing admits it (streaming: with fragment 0's exchange in flight); all three finish."""
    # the launcher runs in this process (it has imported torch already): one interpreter start fewer per job
    (tmp_path / "job.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)  # the job's directory: the joiner runs the script here too
    monkeypatch.delenv("ISLANDS_TOKEN", raising=False)
    # its workers forked from a server that imported torch and islands (`islands run --preload`): ~2 CPU-s less each
    monkeypatch.setenv(spawn.PRELOAD_ENV, "islands")
    out, launcher = tmp_path / "out", io.StringIO()
    seen: dict = {}
    ended = threading.Event()

    def waiting(what, check):
        def look():
            if ended.is_set():  # the job ended first: say why
                raise AssertionError(
                    f"the job ended while waiting for {what}:\n{launcher.getvalue()}"
                    + elastic_jobs.logs(tmp_path / "run")
                )
            return check()

        elastic_jobs.wait(look, what, TIMEOUT, log=lambda: launcher.getvalue() + elastic_jobs.logs(tmp_path / "run"))

    def act(address):
        """The test's side, on a thread: the joiner starts at once (its start-up overlaps the job's) and asks to
        join once the survivors are at the gate; they go on once it is ready."""
        joiner = seen["joiner"] = elastic_jobs.join(
            address, "--token-file", str(tmp_path / "run" / "token"), name="j1", cwd=tmp_path
        )
        try:
            waiting("the survivors at the gate", elastic_jobs.at_gate(out, ["w0", "w1"]))
            seen["w2 at the gate"] = (out / "gate-w2").exists()
            (out / "admit").write_text("")
            waiting("the joiner to be ready", elastic_jobs.has_key(address, "ready/j1"))
            (out / "go").write_text("")
            seen["joined"] = joiner.communicate(timeout=TIMEOUT)[0]
        except BaseException as e:  # noqa: BLE001 - surfaced after the job
            seen["error"] = e
            joiner.kill()
            elastic_jobs.kill_job_processes(f"{tmp_path}/")  # the job's workers and the joiner's script: end the job

    threads: list[threading.Thread] = []

    def started(address, workers, host):
        threads.append(threading.Thread(target=act, args=(address,), daemon=True))
        threads[0].start()

    argv = [
        str(tmp_path / "job.py"),
        "--out",
        "out",
        "--steps",
        str(STEPS),
        "--outer",
        outer,
        "--die",
        "w2:9",
        "--gate",
        "14",
        *(["--authenticate"] if authenticate else []),
        *(["--stage"] if staged else []),
    ]
    try:
        code = launch_elastic_script(
            argv, 3, tmp_path / "run", heartbeat_timeout=5.0, timeout=60.0, out=launcher, on_started=started
        )
    finally:
        ended.set()
        for t in threads:
            t.join(timeout=TIMEOUT)
        if "joiner" in seen and seen["joiner"].poll() is None:
            seen["joiner"].kill()
        elastic_jobs.kill_job_processes(f"{tmp_path}/")  # never leave a process behind
    log = launcher.getvalue()
    if "error" in seen:
        raise seen["error"]
    assert code == 0, log + elastic_jobs.logs(tmp_path / "run")
    assert not seen["w2 at the gate"]
    assert seen["joiner"].returncode == 0, seen["joined"] + elastic_jobs.logs(tmp_path / "run")
    assert "worker w2 left (killed by SIGKILL)" in log, log
    assert not (out / "w2.json").exists()
    members = {n: json.loads((out / f"{n}.json").read_text()) for n in ("w0", "w1")}
    j1 = json.loads((out / "j1.json").read_text())
    assert {r["tagged"] for r in (*members.values(), j1)} == {authenticate}
    assert {r["cross"] for r in (*members.values(), j1)} == {"StagedElasticComm" if staged else "ElasticComm"}

    # the death: dropped at the exchange in flight (streaming, tau=1) or the next one (gossip), retried with the
    # survivors; every exchange committed in the same epoch with the same members on both
    assert members["w0"]["syncs"] == members["w1"]["syncs"]
    # the exchange that failed over
    kind = "outer_params" if outer in ("gossip", "push-sum", "overlap") else "outer_delta"
    for r in members.values():
        failures = [e for e in r["events"] if e["type"] == "failure"]
        assert [(f["gone"], f["kind"]) for f in failures] == [(["w2"], kind)], failures
        sizes = [size for _, size in r["syncs"]]
        assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3 and r["size"] == 3

    # the join: the members admitted it at the same step and round, right after a landing past the gate; it holds
    # the lowest-ranked holder's model, the step and the round counter
    joins = {n: next(e for e in r["events"] if e["type"] == "join") for n, r in members.items()}
    entered = next(e for e in j1["events"] if e["type"] == "entered")
    assert {(e["step"], e["round"]) for e in joins.values()} == {(entered["step"], entered["round"])}
    assert j1["entered"]["start"] == entered["step"] >= 14 and j1["entered"]["rounds"] == entered["round"]
    assert entered["global_sha256"] == joins["w0"]["global_sha256"] == j1["entered"]["sha"]
    if outer in ("streaming", "overlap"):  # an exchange was in flight: it came with the state and landed here too
        assert j1["entered"]["inflight"] == 1
    # from its entry on it was in every exchange, in the members' epochs
    tail = len(j1["syncs"])
    assert tail > 0 and all(size == 3 for _, size in j1["syncs"])
    for r in members.values():
        assert r["syncs"][-tail:] == j1["syncs"] and r["rounds"] == j1["rounds"]

    if outer in ("gossip", "push-sum"):
        # two survivors mix with each other every round (exp graph; random:s=1 with push-sum weights, whose one
        # out-peer of two is the other): equal models at the join show that both planned the same graph after
        # the failure; with three nodes they keep their own models (no global one)
        assert joins["w0"]["global_sha256"] == joins["w1"]["global_sha256"]
        assert j1["rounds"] == STEPS // 3  # a round every 3 steps, the last step one of them: none lost
    else:  # one global model, bit for bit, and every exchange started landed exactly once (the one in flight too)
        assert len({r["sha"] for r in members.values()} | {j1["sha"]}) == 1, "members and joiner disagree"
        if outer == "overlap":  # a round every 3 steps, then finish's blocking average
            assert j1["rounds"] == STEPS // 3 + 1
            return
        for r in (*members.values(), j1):
            assert r["sends"] == _expected_sends(outer) and r["rounds"] == sum(r["sends"])


@pytest.mark.parametrize(
    "outer,needle",
    [
        ("diloco:inner_steps=5,tau=1", None),
        ("streaming-diloco:inner_steps=8,fragments=2,tau=2", None),
        ("gossip:every=3,topology=random:s=1", None),
        ("overlap-local-sgd:tau=2", None),
        ("diloco:overlap=delayed", "overlap=delayed"),
        ("streaming-diloco:lr_scale=sqrt-islands", "lr_scale=sqrt-islands with fragments > 1"),
        ("gossip:compressor=(topk:warmup=0)", "compressed gossip"),
    ],
)
def test_elastic_validation_lifts_what_works_under_churn_and_names_what_does_not(outer, needle):
    from islands.app.validate import validate
    from islands.config import ConfigError, from_mapping

    cfg = from_mapping(dict(task="digits", workers=3, islands=3, outer=outer, elastic=True, global_batch=24))
    if needle is None:
        assert validate(cfg).elastic.enabled
        return
    with pytest.raises(ConfigError, match=needle):
        validate(cfg)
