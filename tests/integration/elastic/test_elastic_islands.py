"""Islands of k workers as the unit of elastic membership (issue #20 item 1; docs/membership.md, "Islands of k
workers"). On gloo: the IslandComm relay gives every worker of every island the plain cross-island result, and its
per-slot form (fsdp's shards) worker j of every island the result of the workers j; a digits job of 2 islands x 2
workers (a BatchNorm CNN, ddp or fsdp inside, DiLoCo across) whose island 1 loses a worker to SIGKILL goes on with
island 0, the launcher restarts island 1 as a new incarnation, which is admitted at a round boundary with the global
state and ends bit-equal with island 0; without faults elastic fsdp ends where a fixed world does; with
--max-restarts 0 the island stays out and the job still finishes; combinations that cannot work exit 2 with a
message naming why."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_checkpoint_resume import same

from harness.elastic import QUIET_ELASTIC, assert_nothing_half_written, gated_digits
from harness.world import spawn_ranks
from islands.app.launch import launch_elastic
from islands.app.validate import validate
from islands.checkpoint import CheckpointStore
from islands.config import from_mapping
from islands.runtime.elastic.island_comm import IslandComm, IslandPlace, worker_name
from islands.runtime.elastic.membership import connect

HEARTBEAT = 5.0  # seconds; generous: the test machine is shared and loaded (a false death would fail it)


# ---- the relay, on 4 gloo ranks (2 islands x 2 workers) ------------------------------------------------
def _relay_rank(rank, env, queue):
    os.environ.update(env)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    # every rank makes every group, in the same order (torch's rule)
    local = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    side = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    leaders = dist.new_group([0, 2])
    from islands.runtime.comm import Comm, CommLedger

    class Planned(Comm):  # exchange_planned as an ElasticComm has it, over a fixed group
        def exchange_planned(self, plan, like, kind="p2p"):
            sends, recv_from = plan(self.rank, self.size)
            return self.exchange(sends, recv_from, like=like, kind=kind), sorted(sends), list(recv_from)

    def never(rank, size):
        raise AssertionError("a follower's plan is never called")

    ledger = CommLedger()
    cross = Planned(leaders, ledger) if rank % 2 == 0 else None
    relay = IslandComm(cross, ledger, group=local, side=side)
    island = rank // 2
    # island replicas are identical (inner DDP keeps them so): each island's input depends on the island only
    x = torch.arange(5, dtype=torch.float32) * (island + 1) + 0.25 * island
    summed = relay.all_reduce(x.clone(), kind="outer_delta")
    maxed = relay.all_reduce(x.clone(), op=dist.ReduceOp.MAX, kind="outer_delta")
    gathered = relay.all_gather(x[:3].clone(), kind="outer_gather")
    # src in the cross Comm's numbering: island 1's leader is global rank 2 of this plain Comm
    sent = relay.broadcast(x.clone() if island == 1 else torch.zeros(5), src=2, kind="outer_bcast")
    # gossip's round: a ring of the 2 islands, planned by the leader only
    got, send_to, recv_from = relay.exchange_planned(
        (lambda r, n: ({(r + 1) % n: x.clone()}, [(r - 1) % n])) if cross is not None else never,
        like=torch.empty(5),
        kind="gossip",
    )
    # an exchange in flight on another thread relays over the side group while the training thread's own
    # collectives go on over the local group: neither waits on nor mixes with the other
    box: dict = {}

    def in_flight():
        box["sums"] = [relay.all_reduce(x.clone() * i, kind="outer_delta").tolist() for i in range(1, 4)]

    thread = threading.Thread(target=in_flight)
    thread.start()
    local_sums = [dist.all_reduce(t := torch.full((3,), float(i + rank)), group=local) or t.tolist() for i in range(6)]
    thread.join(60)
    objects = relay.all_gather_object({"rank": rank})
    # fsdp's shards: worker j of each island holds slot j, of its own length (3 and 2 values, as FSDP's padding
    # leaves a last shard short), and meets only slot j of the other island
    slots = relay.per_slot()
    mine = torch.arange(3.0 - rank % 2) + 10 * island + 100 * (rank % 2)
    slot_sum = slots.all_reduce(mine.clone(), kind="outer_delta")
    slot_gathered = slots.all_gather(mine.clone(), kind="outer_gather")
    slot_sent = slots.broadcast(mine.clone(), src=2, kind="outer_bcast")
    # plain lists through the queue: a tensor would be passed as a file descriptor of this exiting process
    queue.put(
        (
            rank,
            summed.tolist(),
            maxed.tolist(),
            [g.tolist() for g in gathered],
            sent.tolist(),
            objects,
            relay.rank,
            relay.size,
            dict(ledger.sent),
            ({p: t.tolist() for p, t in got.items()}, send_to, recv_from),
            box.get("sums"),
            local_sums,
            (slot_sum.tolist(), [g.tolist() for g in slot_gathered], slot_sent.tolist()),
        )
    )
    dist.destroy_process_group()


def test_the_island_relay_gives_every_worker_the_plain_result_over_islands():
    got = spawn_ranks(_relay_rank, 4, timeout=120)
    inputs = [torch.arange(5, dtype=torch.float32) * (i + 1) + 0.25 * i for i in range(2)]
    for rank, summed, maxed, gathered, sent, objects, irank, isize, sent_bytes, gossip, sums, local_sums, slot in got:
        assert summed == (inputs[0] + inputs[1]).tolist()  # the all-reduce over islands, on every worker
        assert maxed == torch.maximum(inputs[0], inputs[1]).tolist()
        assert gathered == [inputs[0][:3].tolist(), inputs[1][:3].tolist()]
        assert sent == inputs[1].tolist()
        other = 1 - rank // 2
        assert gossip == ({other: inputs[other].tolist()}, [other], [other])  # the leader's round, relayed
        assert sums == [((inputs[0] + inputs[1]) * i).tolist() for i in range(1, 4)]
        mates = [rank - rank % 2, rank - rank % 2 + 1]
        assert local_sums == [[float(sum(i + m for m in mates))] * 3 for i in range(6)]
        assert objects == [{"rank": r} for r in range(4)]  # bookkeeping: every worker, in global rank order
        assert (irank, isize) == (rank // 2, 2)
        # only leaders send cross-island bytes; followers receive the relay only
        assert ("outer_delta" in sent_bytes) == (rank % 2 == 0)
        j = rank % 2  # the slot: worker j of island 0 and worker j of island 1, nobody else
        ours = [(torch.arange(3.0 - j) + 10 * i + 100 * j).tolist() for i in range(2)]
        assert slot == ([a + b for a, b in zip(*ours)], ours, ours[1])


def test_worker_names_and_places():
    assert [worker_name(0, 0, 1), worker_name(2, 0, 1, 1)] == ["w0", "w2.1"]  # one-worker islands as before
    assert [worker_name(1, 0, 2), worker_name(1, 1, 2, 3)] == ["i1w0", "i1w1.3"]
    place = IslandPlace.from_env("1,1,2,3")
    assert place == IslandPlace(1, 1, 2, 3) and not place.leader and place.name(0) == "i1w0.3"
    assert IslandPlace.from_env(place.to_env()) == place and IslandPlace.from_env("") is None
    for bad in ("1,2", "a,b,c,d", "0,2,2,0"):
        with pytest.raises(ValueError):
            IslandPlace.from_env(bad)


# ---- whole jobs ---------------------------------------------------------------------------------------
STEPS = 40  # eight rounds of 5: two before the kill, the join at a boundary after the restart, rounds after it


def _cfg(tmp_path: Path, **over):
    """A digits job of our own BatchNorm CNN behind a gate (tests/harness/elastic.py): the test holds the surviving
    island at work until the restarted island is built (on a loaded machine its start-up takes longer than the
    whole job would)."""
    task, hold = gated_digits(tmp_path)
    values = dict(
        QUIET_ELASTIC,
        task=task,
        workers=4,
        islands=2,
        inner="ddp",
        outer="diloco:inner_steps=5",
        steps=STEPS,
        global_batch=32,
        warmup=2,
        heartbeat_timeout=HEARTBEAT,
        run_dir=str(tmp_path / "run"),
    )
    values.update(over)
    cfg = from_mapping(values)
    cfg.task.options.update(hold=str(hold), model="bn-cnn")
    return validate(cfg)


def _wait(cond, what: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _records(run_dir: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (run_dir / "elastic").glob("*.json") if p.stem != "restarts"}


def _kept_model(cfg, run_dir: Path) -> str:
    """The digest of the one model the job kept (RUN_DIR/model, written by the last epoch's rank 0: island 0's
    leader), loaded strictly into the task's model; a second model or a half-written one fails here."""
    from safetensors.torch import load_model

    from islands.app.build import build_task
    from islands.runtime.elastic import global_digest

    kept = [p.name for p in run_dir.iterdir() if p.name.startswith((".model", "model"))]
    assert kept == ["model"], kept
    model = build_task(cfg).model
    load_model(model, str(run_dir / "model" / "model.safetensors"))
    return global_digest(model)


def _run(cfg, run_dir: Path, fault) -> tuple[int, str]:
    errors: list = []

    def body(address, workers):
        try:
            fault(address, workers)
        except BaseException as e:  # noqa: BLE001 - surfaced after the job
            errors.append(e)
        finally:
            hold = Path(cfg.task.options["hold"])
            hold.unlink(missing_ok=True)  # never leave the job waiting

    out = io.StringIO()
    code = launch_elastic(
        cfg,
        run_dir,
        out=out,
        on_started=lambda a, w, c: threading.Thread(target=body, args=(a, w), daemon=True).start(),
    )
    assert not errors, errors
    return code, out.getvalue()


def _kill_after_two_rounds(hold: Path, index: int, ready: str, names: list[str] | None = None):
    """A fault: after two rounds, SIGKILL worker `index`; hold the other islands until `ready` (the restarted
    leader) is built (on a loaded machine its start-up takes longer than the whole job would)."""

    def fault(address, workers):
        host, port = address.split(":")
        store = connect(host, int(port))
        _wait(lambda: store.check(["round/2/join"]), "two rounds")
        if names is not None:
            assert [w.name for w in workers] == names
        hold.write_text("")
        os.kill(workers[index].proc.pid, signal.SIGKILL)
        _wait(lambda: store.check([f"ready/{ready}"]), "the restarted island's leader to be built")
        hold.unlink()

    return fault


# fsdp: each worker holds its shard; the leader exchanges the island's packed shards, holders serve the island's
# whole global model and every worker's own strategy state, and the restarted island's workers load their slots
@pytest.mark.parametrize(
    "inner,victim", [("ddp", 3), ("fsdp", 3), ("fsdp", 2)], ids=["ddp-follower", "fsdp-follower", "fsdp-leader"]
)
def test_a_killed_worker_takes_its_island_out_and_the_restarted_island_rejoins_with_the_global_state(
    tmp_path, inner, victim
):
    cfg = _cfg(tmp_path, max_restarts=1, inner=inner)
    run_dir = tmp_path / "run"
    hold = tmp_path / "HOLD"
    seen: dict = {}

    def fault(address, workers):
        host, port = address.split(":")
        store = connect(host, int(port))
        _wait(lambda: store.check(["round/2/join"]), "two rounds")
        assert [w.name for w in workers] == ["i0w0", "i0w1", "i1w0", "i1w1"]
        hold.write_text("")  # island 0 keeps going only once the restarted island is ready
        os.kill(workers[victim].proc.pid, signal.SIGKILL)  # island 1's follower (3) or leader (2)
        seen["killed"] = time.time()
        _wait(lambda: store.check(["ready/i1w0.1"]), "the restarted island's leader to be built")
        hold.unlink()

    code, log = _run(cfg, run_dir, fault)
    assert code == 0, log
    # the launcher may see the killed follower's exit first, or its leader's (its local collective failed) first
    dead = f"i1w{victim - 2}"
    assert "island 1 left the job" in log and (
        f"worker {dead} left (killed by SIGKILL)" in log or f"stopped {dead}" in log
    ), log
    assert "restarting island 1 (restart 1 of 1) as i1w0.1, i1w1.1" in log, log
    restarts = json.loads((run_dir / "elastic" / "restarts.json").read_text())
    assert [(r["island"], r["incarnation"], r["workers"]) for r in restarts["restarts"]] == [
        (1, 1, ["i1w0.1", "i1w1.1"])
    ]
    recs = _records(run_dir)
    assert set(recs) == {"i0w0", "i0w1", "i1w0.1", "i1w1.1"}, log  # the killed island wrote nothing
    # every surviving worker of both islands holds the same global model, bit for bit
    assert len({r["global_sha256"] for r in recs.values()}) == 1, {n: r["global_sha256"] for n, r in recs.items()}
    events = recs["i0w0"]["final"]["events"]
    # island 1's old leader leaves through a failed exchange, or, when island 0 reaches no exchange before the
    # restarted island is ready (it is held), through the join's new epoch, which leaves the dead member out
    failure = next((e for e in events if e["type"] == "failure"), None)
    if failure is not None:
        assert failure["gone"] == ["i1w0"] and failure["detected"] >= seen["killed"]
    join = next(e for e in events if e["type"] == "join")
    assert join["joined"] == ["i1w0.1"] and join["size"] == 2  # island 0's leader and the restarted one
    # the restarted leader entered through admission with the members' global model and step ...
    entered = next(e for e in recs["i1w0.1"]["final"]["events"] if e["type"] == "entered")
    assert entered["global_sha256"] == join["global_sha256"] and entered["step"] == join["step"] > 10
    assert recs["i1w0.1"]["initial"] is False and recs["i1w0.1"]["island"]["index"] == 1
    # each worker keeps its island's shard: index * k + local of islands * k
    assert [recs[n]["data_shard"] for n in ("i0w0", "i0w1", "i1w0.1", "i1w1.1")] == [[0, 4], [1, 4], [2, 4], [3, 4]]
    # ... and handed them to its follower, which starts at the same step
    follower = next(e for e in recs["i1w1.1"]["final"]["events"] if e["type"] == "entered")
    assert follower["via"] == "i1w0.1" and follower["step"] == entered["step"]
    if inner == "fsdp":  # the restarted island's workers, having loaded their slots, hold the members' model together
        assert follower["global_sha256"] == entered["global_sha256"]
    run = json.loads((run_dir / "run.json").read_text())
    assert run["summary"]["steps"] == STEPS and run["summary"]["workers"] == 4 and run["summary"]["islands"] == 2
    assert_nothing_half_written(run_dir)
    # the job keeps one model, the global one every survivor holds, and its record says where
    assert _kept_model(cfg, run_dir) == recs["i0w0"]["global_sha256"]
    assert run["model"]["step"] == STEPS and run["model"]["dir"] == str(run_dir / "model")
    # the workers' output went to their logs: the launcher ends with the summary and where the files are
    assert "islands run summary" in log and f"model: {run_dir / 'model'} (step {STEPS}, safetensors)" in log, log


# topk: each worker compresses its own shard (error feedback per shard) and the payloads are all-gathered per slot
@pytest.mark.parametrize("outer", ["diloco:inner_steps=5", "diloco:inner_steps=5,compressor=(topk:ratio=0.1)"])
def test_an_elastic_fsdp_job_without_faults_ends_with_the_fixed_world_jobs_global_model(tmp_path, outer):
    """Elastic fsdp+diloco (each island's packed shards exchanged by its leader) against the same job in a fixed
    world (worker j of each island exchanging shard j over the "cross" group): same data shards, same payloads,
    same sums of two values in fp32, so the same global model bit for bit."""
    from islands.app.launch import launch
    from islands.runtime.elastic import state_digest

    elastic_run, fixed_run = tmp_path / "elastic", tmp_path / "fixed"
    steps = 25  # five rounds: the jobs' start-up is most of their CPU, and the equality holds from the first round
    cfg = _cfg(tmp_path, inner="fsdp", outer=outer, steps=steps, run_dir=str(elastic_run))
    code, log = _run(cfg, elastic_run, lambda address, workers: None)
    assert code == 0, log
    digests = {n: r["global_sha256"] for n, r in _records(elastic_run).items()}
    assert set(digests) == {"i0w0", "i0w1", "i1w0", "i1w1"} and len(set(digests.values())) == 1, digests
    fixed = _cfg(
        tmp_path, inner="fsdp", outer=outer, steps=steps, elastic=False, ckpt_every=steps, run_dir=str(fixed_run)
    )
    assert launch(fixed, fixed_run, out=io.StringIO()) == 0
    final = CheckpointStore(fixed_run / "ckpt", clean=False).load(steps, rank=0).tree["model"]
    assert state_digest(final) == digests["i0w0"]
    # each job kept the gathered global model once (fsdp: a collective every worker joins, island 0's leader writes)
    assert _kept_model(cfg, elastic_run) == _kept_model(fixed, fixed_run) == digests["i0w0"]
    summaries = [json.loads((run / "run.json").read_text())["summary"] for run in (elastic_run, fixed_run)]
    assert summaries[0]["final_val_loss"] == summaries[1]["final_val_loss"]


@pytest.mark.parametrize(
    "outer,across,ckpt,inner",
    [
        # streaming DiLoCo: 2 fragments, each landing one step after it left, on the strategy's exchange thread
        ("diloco:inner_steps=6,fragments=2,tau=1", True, 0, "ddp"),
        # gossip on a ring: the leader's point-to-point round relayed to its follower (islands need not agree)
        ("gossip:every=5,topology=ring", False, 0, "ddp"),
        # checkpoints every round: every worker saves its part, the join waits for the due save on all of them
        ("diloco:inner_steps=5", True, 5, "ddp"),
        # the same under fsdp: a holder's followers settle the save, then build the island's state with their leader
        ("diloco:inner_steps=5", True, 5, "fsdp"),
    ],
)
def test_exchanges_in_flight_gossip_and_checkpoints_survive_a_killed_worker_in_k_worker_islands(
    tmp_path, outer, across, ckpt, inner
):
    cfg = _cfg(tmp_path, max_restarts=1, outer=outer, ckpt_every=ckpt, inner=inner)
    run_dir, hold = tmp_path / "run", tmp_path / "HOLD"

    code, log = _run(cfg, run_dir, _kill_after_two_rounds(hold, 3, "i1w0.1"))  # a follower of island 1
    assert code == 0, log
    assert "restarting island 1 (restart 1 of 1) as i1w0.1, i1w1.1" in log, log
    recs = _records(run_dir)
    assert set(recs) == {"i0w0", "i0w1", "i1w0.1", "i1w1.1"}, log
    digest = {n: r["global_sha256"] for n, r in recs.items()}
    # the workers of an island hold one model, bit for bit (the relay is exact) ...
    assert digest["i0w0"] == digest["i0w1"] and digest["i1w0.1"] == digest["i1w1.1"], digest
    if across:  # ... and DiLoCo's islands the same global model
        assert len(set(digest.values())) == 1, digest
    join = next(e for e in recs["i0w0"]["final"]["events"] if e["type"] == "join")
    entered = next(e for e in recs["i1w0.1"]["final"]["events"] if e["type"] == "entered")
    follower = next(e for e in recs["i1w1.1"]["final"]["events"] if e["type"] == "entered")
    assert join["joined"] == ["i1w0.1"] and entered["step"] == join["step"] == follower["step"] > 5
    run = json.loads((run_dir / "run.json").read_text())
    assert run["summary"]["steps"] == STEPS and run["summary"]["islands"] == 2
    if ckpt:
        store = CheckpointStore(run_dir / "ckpt", clean=False)
        assert store.latest_step() == STEPS
        # the last checkpoint has a part per worker, each on its own data shard, all of one global model
        parts = [store.load(STEPS, rank=r).tree for r in range(4)]
        assert sorted(t["world"]["shard"] for t in parts) == [0, 1, 2, 3]
        assert all(same(parts[0]["model"], t["model"]) for t in parts[1:])
        assert run["checkpoint"]["saves"]["local"] >= STEPS // 5 - 2  # every 5 steps, but at most two skipped


@pytest.mark.parametrize(
    "inner,victim",
    [("ddp", 3), ("fsdp", 3), ("fsdp", 2), ("fsdp", 0)],
    ids=["ddp-follower-1", "fsdp-follower-1", "fsdp-leader-1", "fsdp-leader-0"],
)
def test_with_no_restarts_left_the_island_stays_out_and_the_job_finishes(tmp_path, inner, victim):
    """Any worker killed (a follower or a leader, of either island, fsdp or ddp inside): its island leaves as a
    whole and the other finishes the job alone, its two workers agreeing."""
    cfg = _cfg(tmp_path, max_restarts=0, inner=inner)
    run_dir = tmp_path / "run"
    gone, kept = (1, 0) if victim >= 2 else (0, 1)

    def fault(address, workers):
        host, port = address.split(":")
        store = connect(host, int(port))
        _wait(lambda: store.check(["round/2/join"]), "two rounds")
        os.kill(workers[victim].proc.pid, signal.SIGKILL)

    code, log = _run(cfg, run_dir, fault)
    assert code == 0, log
    assert f"island {gone} left the job" in log and "restarting" not in log, log
    assert not (run_dir / "elastic" / "restarts.json").exists()
    recs = _records(run_dir)
    assert set(recs) == {f"i{kept}w0", f"i{kept}w1"}, log
    assert recs[f"i{kept}w0"]["global_sha256"] == recs[f"i{kept}w1"]["global_sha256"]
    failure = next(e for e in recs[f"i{kept}w0"]["final"]["events"] if e["type"] == "failure")
    assert failure["gone"] == [f"i{gone}w0"] and failure["size"] == 1
    run = json.loads((run_dir / "run.json").read_text())
    assert run["summary"]["steps"] == STEPS and run["summary"]["workers"] == 2 and run["summary"]["islands"] == 1


@pytest.mark.parametrize(
    "flags,needle",
    [
        # fsdp takes plain diloco rounds only (the sharding rule), in elastic jobs too
        (["--inner", "fsdp", "--outer", "gossip:every=5"], "'gossip' is not wired for sharded parameters"),
        (["--inner", "fsdp", "--outer", "diloco:inner_steps=6,fragments=2"], "fragments=2 is not wired"),
        (["--inner", "pipeline"], "inner.strategy=pipeline splits one model over the island"),
        (["--workers", "3"], "world.workers (3) must be divisible by world.islands (2)"),
        (["--max-restarts", "-1"], "elastic.max_restarts must be an integer >= 0"),
        (["--no-elastic", "--max-restarts", "2"], "elastic.max_restarts applies to elastic jobs"),
    ],
)
def test_combinations_that_cannot_work_exit_2_before_anything_starts(tmp_path, capsys, flags, needle):
    from islands.cli import main

    base = [
        "train",
        "--task",
        "digits",
        "--workers",
        "4",
        "--islands",
        "2",
        "--inner",
        "ddp",
        "--outer",
        "diloco:inner_steps=5",
        "--elastic",
        "--global-batch",
        "24",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    with pytest.raises(SystemExit) as exited:
        main(base + flags)
    assert exited.value.code == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_elastic_rule_takes_fsdp_with_checkpoints_and_names_why_it_refuses_pipelines():
    from islands.app.validate import elastic

    base = dict(task="digits", workers=4, islands=2, outer="diloco:inner_steps=5", elastic=True, global_batch=24)
    assert elastic(from_mapping(dict(base, inner="fsdp"))) is None
    assert elastic(from_mapping(dict(base, inner="fsdp", ckpt_every=5))) is None  # test_checkpoint_elastic resumes one
    message = elastic(from_mapping(dict(base, inner="pipeline")))
    assert "inner.strategy=pipeline is refused" in message
    assert "no one worker holds the island's global model" in message


def test_islands_join_is_refused_in_a_job_of_k_worker_islands_before_admission(tmp_path, monkeypatch, capsys):
    from islands.app.elastic_worker import main
    from islands.runtime.elastic.membership import REFUSED_EXIT_CODE, Coordinator, JobSpec, host_store

    cfg = _cfg(tmp_path)  # 4 workers in 2 islands
    server, store = host_store(0)
    coord = Coordinator(store, "secret", JobSpec(workers=2, config=cfg.to_dict()), log=lambda line: None).start()
    monkeypatch.delenv("ISLANDS_ISLAND", raising=False)
    monkeypatch.setenv("ISLANDS_TOKEN", "secret")
    monkeypatch.setenv("ISLANDS_NAME", "j1")
    try:
        code = main([f"127.0.0.1:{server.port}", str(tmp_path / "joiner")])
    finally:
        coord.stop()
    assert code == REFUSED_EXIT_CODE
    err = capsys.readouterr().err
    assert "this job's islands have 2 workers each" in err and "--max-restarts" in err, err
    assert coord.admitted == [] and not (tmp_path / "joiner").exists()  # refused before admission, nothing written


def test_a_one_worker_island_is_restarted_the_same_way_on_its_own_shard(tmp_path):
    cfg = _cfg(tmp_path, workers=2, islands=2, inner="auto", max_restarts=1, global_batch=16)
    run_dir = tmp_path / "run"
    hold = tmp_path / "HOLD"

    code, log = _run(cfg, run_dir, _kill_after_two_rounds(hold, 1, "w1.1", names=["w0", "w1"]))
    assert code == 0, log
    assert "restarting island 1 (restart 1 of 1) as w1.1" in log, log
    recs = _records(run_dir)
    assert set(recs) == {"w0", "w1.1"}, log
    assert recs["w0"]["global_sha256"] == recs["w1.1"]["global_sha256"]
    # the restarted island trains on island 1's data, whatever shard its admission order would have given it
    assert recs["w1.1"]["island"] == {"index": 1, "local": 0, "size": 1, "incarnation": 1, "leader": "w1.1"}
    assert recs["w1.1"]["data_shard"] == [1, 2] and recs["w0"]["data_shard"] == [0, 2]
    join = next(e for e in recs["w0"]["final"]["events"] if e["type"] == "join")
    assert join["joined"] == ["w1.1"]
