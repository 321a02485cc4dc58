"""Authenticated payloads in elastic jobs (ElasticComm.authenticate): every tensor an operation sends is tagged
under the job's key and the operation's e/<epoch>/s/<seq>, checked by each receiver before its ok. In-process
members (threads over a real job store and gloo) for the collectives and for what a receiver refuses; whole
`islands train --elastic` jobs for the end-to-end results."""

from __future__ import annotations

import threading

import pytest
import torch

from harness.elastic import elastic_config
from islands.runtime.comm import CommLedger
from islands.runtime.elastic import elastic_member, membership
from islands.runtime.elastic.membership import Coordinator, JobSpec, host_store, join_job
from islands.runtime.payload_auth import PayloadAuthError

TOKEN = "the-elastic-job-secret"
NAMES = ("a", "b", "c")


def _members(body, names=NAMES, token_of=lambda name: TOKEN, authenticate: bool = True) -> tuple[dict, dict]:
    """Run `body(comm, index)` on one thread per member of a fresh job (each member authenticated with
    `token_of(name)`); returns ({name: body's result}, {name: the exception it raised}). A member that raises
    leaves as a worker does (close_world: heartbeat stopped, dead flag set), so the others can go on."""
    server, raw = host_store(0)
    coord = Coordinator(raw, TOKEN, JobSpec(workers=len(names), heartbeat_timeout=1.0, timeout=10.0)).start()
    sessions = [join_job("127.0.0.1", server.port, n, TOKEN) for n in names]
    results, errors = {}, {}

    def member(i, s):
        member = elastic_member(s.store, s.auth.sender, CommLedger(), heartbeat_timeout=1.0, collective_timeout=10.0)
        member.job = s.job
        member.heartbeat = membership.Heartbeat(
            "127.0.0.1", server.port, s.auth.sender, auth=s.auth, new_client=s.new_client
        )
        try:
            member.epochs.form(0, None)
            if authenticate:
                member.authenticate(token_of(s.auth.sender))
            results[s.auth.sender] = body(member.comm, i)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors[s.auth.sender] = e
        finally:
            member.leave()

    threads = [threading.Thread(target=member, args=(i, s)) for i, s in enumerate(sessions)]
    try:
        [t.start() for t in threads]
        [t.join(60) for t in threads]
    finally:
        coord.stop()
    assert not any(t.is_alive() for t in threads), "a member hung"
    return results, errors


def test_tagged_operations_give_the_plain_results():
    def body(comm, i):
        r = comm.rank
        out = {
            "sum": comm.all_reduce(torch.arange(4.0) * (r + 1)).tolist(),
            "max": comm.all_reduce(
                torch.tensor([r, -r], dtype=torch.int64), op=torch.distributed.ReduceOp.MAX
            ).tolist(),
            "gather": [t.tolist() for t in comm.all_gather(torch.full((2, 2), r, dtype=torch.bfloat16))],
            "bcast": comm.broadcast(torch.full((3,), float(r)), src=1).tolist(),
            "objects": comm.all_gather_object({"name": comm.name}),
        }

        def ring(rank, size):
            return {(rank + 1) % size: torch.full((2,), float(rank))}, [(rank - 1) % size]

        got, send_to, recv_from = comm.exchange_planned(ring, torch.zeros(2))
        out["p2p"] = {p: t.tolist() for p, t in got.items()}
        out["keys"] = [s["epoch"] * 100 + s["seq"] for s in comm.syncs]
        out["sent"] = dict(comm.ledger.sent)
        return out

    results, errors = _members(body)
    assert not errors, errors
    for i, name in enumerate(NAMES):
        got = results[name]
        assert got["sum"] == [0.0, 6.0, 12.0, 18.0]
        assert got["max"] == [2, 0]
        assert got["gather"] == [[[r, r], [r, r]] for r in range(3)]
        assert got["bcast"] == [1.0, 1.0, 1.0]
        assert got["objects"] == [{"name": n} for n in NAMES]
        assert got["p2p"] == {(i - 1) % 3: [float((i - 1) % 3)] * 2}
        assert got["keys"] == list(range(len(got["keys"])))  # one epoch, no fail-over
        assert got["sent"]["all_reduce"] == 2 * (16 + 32)  # two sums of 16 bytes, each with its 32-byte tag


class Tamper:
    """Stands in the network path in front of one member: what it receives passes `edit(fields, packed)` before
    the member's check (fields: kind, operation key, sender, receiver)."""

    def __init__(self, tags, edit):
        self.tags, self.edit = tags, edit

    def pack(self, t, fields):
        return self.tags.pack(t, fields)

    def open(self, packed, like, fields):
        return self.tags.open(self.edit(fields, packed.clone()), like, fields)


def _sums_with_a_tampering(edit):
    """a, b, c all-reduce three times while a's inbound payloads pass `edit`. Returns what each finished with."""

    def body(comm, i):
        if comm.name == "a":
            comm.tags = Tamper(comm.tags, edit)
        out = [comm.all_reduce(torch.tensor([float(i + 1) * (k + 1)])).item() for k in range(3)]
        failures = [e for e in comm.epochs.events if e["type"] == "failure"]
        return out, [(s["epoch"], s["seq"], s["size"]) for s in comm.syncs], failures

    return _members(body)


def _flip_b_at_op1(fields, packed):
    kind, key, sender, receiver = fields
    if key == "e/0/s/1" and sender == "b":
        packed[1] ^= 0x10  # one bit of b's contribution to the second operation
    return packed


_recorded: dict = {}


def _replay_b_op0_into_op1(fields, packed):
    kind, key, sender, receiver = fields
    if sender == "b" and key == "e/0/s/0":
        _recorded["b"] = packed.clone()
    if sender == "b" and key == "e/0/s/1":
        return _recorded["b"]  # b's genuine payload of the first operation, replayed into the second
    return packed


@pytest.mark.parametrize("edit", [_flip_b_at_op1, _replay_b_op0_into_op1], ids=["altered", "replayed"])
def test_a_refused_contribution_fails_the_operation_and_the_others_retry_it_tagged_in_a_new_epoch(edit):
    results, errors = _sums_with_a_tampering(edit)
    assert set(errors) == {"a"} and isinstance(errors["a"], PayloadAuthError), errors
    message = str(errors["a"])
    assert "from member b" in message and "operation e/0/s/1" in message, message
    for name in ("b", "c"):
        out, syncs, failures = results[name]
        # the first sum had all three; the second, failed by a, was retried by b and c alone under epoch 1's
        # key (their tags verified there), so nothing a refused, and nothing of a's, entered it
        assert out == [6.0, 10.0, 15.0], (name, out)
        assert syncs == [(0, 0, 3), (1, 0, 2), (1, 1, 2)], (name, syncs)
        assert len(failures) == 1 and failures[0]["gone"] == ["a"], failures


def test_a_member_without_the_token_is_refused_by_the_others():
    def body(comm, i):
        return comm.all_reduce(torch.tensor([float(i + 1)])).item()

    results, errors = _members(body, names=("a", "b"), token_of=lambda n: TOKEN if n == "a" else "a-guess")
    assert errors, results  # at least one refuses the other's tags (the first to refuse fails the operation:
    for name, other in (("a", "b"), ("b", "a")):  # the other may see that verdict before it checks, and go on alone)
        if name in errors:
            assert isinstance(errors[name], PayloadAuthError) and f"from member {other}" in str(errors[name])
        else:
            assert results[name] == {"a": 1.0, "b": 2.0}[name]  # its own contribution alone, never the other's


# ---- whole elastic jobs (islands train --elastic, in this process's launcher) ------------------------------
def _job(tmp_path, name: str, workers: int, steps: int, authenticate: bool, during=None):
    """An elastic DiLoCo job of `workers` one-worker digits islands; `during(address, workers)` runs on a thread
    once the workers started. Returns (exit code, launcher log, {member: its record}, run.json)."""
    import io
    import json

    import harness.elastic as elastic_jobs
    from islands.app.launch import launch_elastic

    run = tmp_path / name
    cfg = elastic_config(
        workers=workers,
        islands=workers,
        outer="diloco:inner_steps=3",
        steps=steps,
        global_batch=8 * workers,
        warmup=2,
        heartbeat_timeout=5.0,
        authenticate_payloads=authenticate,
        run_dir=str(run),
    )
    out, errors, threads = io.StringIO(), [], []

    def started(address, procs, coordinator):
        def body():
            try:
                during(address, procs)
            except BaseException as e:  # noqa: BLE001 - surfaced after the job ends
                errors.append(e)

        if during is not None:
            threads.append(threading.Thread(target=body, daemon=True))
            threads[0].start()

    code = launch_elastic(cfg, run, out=out, on_started=started)
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return code, out.getvalue(), elastic_jobs.records(run), json.loads((run / "run.json").read_text())


def test_an_authenticated_elastic_job_ends_bitwise_as_the_plain_one(tmp_path):
    """Two islands: a sum of two contributions is the same in either order, so the tagged job's global model is
    the plain job's bit for bit; every outer exchange carried 32-byte tags."""
    runs = {flag: _job(tmp_path, f"auth-{flag}", 2, 12, flag) for flag in (False, True)}
    digests = {}
    for flag, (code, log, recs, _run) in runs.items():
        assert code == 0, log
        assert set(recs) == {"w0", "w1"}, log
        digests[flag] = {r["global_sha256"] for r in recs.values()}
        assert len(digests[flag]) == 1, f"members disagree (authenticate={flag})"
    assert digests[True] == digests[False]
    plain, auth = (runs[f][3]["comm"]["per_rank"][0]["sent"] for f in (False, True))
    assert (
        auth["outer_delta"] - plain["outer_delta"] == 32 * runs[True][3]["comm"]["per_rank"][0]["calls"]["outer_delta"]
    )


def test_a_worker_killed_in_an_authenticated_elastic_job_is_dropped_and_the_others_agree(tmp_path):
    """w2 is SIGKILLed after three rounds: the survivors fail over to a new epoch, where every retried and later
    exchange is tagged under that epoch's operation keys (a tag under the old key would be refused there), finish,
    and hold the same global model."""
    import signal

    import harness.elastic as elastic_jobs

    def kill_mid_run(address, procs):
        elastic_jobs.wait(elastic_jobs.has_key(address, "round/3/join"), "three rounds", timeout=60)
        procs[2].proc.send_signal(signal.SIGKILL)

    code, log, recs, run = _job(tmp_path, "killed", 3, 150, True, during=kill_mid_run)
    assert code == 0, log
    assert "w2 left (killed by SIGKILL)" in log, log
    assert set(recs) == {"w0", "w1"}, log
    assert len({r["global_sha256"] for r in recs.values()}) == 1, "the survivors disagree on the global model"
    for r in recs.values():
        failures = [e for e in r["final"]["events"] if e["type"] == "failure"]
        assert len(failures) == 1 and failures[0]["gone"] == ["w2"], failures
        deltas = [(s["epoch"], s["size"]) for s in r["syncs"] if s["kind"] == "outer_delta"]
        assert deltas[0] == (0, 3) and deltas[-1][1] == 2 and deltas[-1][0] > 0, deltas
    assert run["summary"]["steps"] == 150


# ---- islands of k workers: their leader's ElasticComm tags what crosses islands -----------------------------
def test_fsdp_islands_of_two_workers_exchange_tagged_shards_with_the_plain_result(tmp_path):
    """2 islands x 2 workers under fsdp: each leader packs its island's shards (SlotComm) into one tagged
    operation; the followers send nothing across islands. Two islands: the same global model as untagged."""
    import json

    from test_elastic_islands import _cfg, _records, _run

    digests, sent = {}, {}
    for flag in (False, True):
        run = tmp_path / f"fsdp-{flag}"
        cfg = _cfg(tmp_path, inner="fsdp", steps=20, authenticate_payloads=flag, run_dir=str(run))
        code, log = _run(cfg, run, lambda address, workers: None)
        assert code == 0, log
        found = {n: r["global_sha256"] for n, r in _records(run).items()}
        assert set(found) == {"i0w0", "i0w1", "i1w0", "i1w1"} and len(set(found.values())) == 1, found
        digests[flag] = found["i0w0"]
        sent[flag] = json.loads((run / "run.json").read_text())["comm"]["per_rank"][0]
    assert digests[True] == digests[False]
    calls = sent[True]["calls"]["outer_delta"]
    assert sent[True]["sent"]["outer_delta"] - sent[False]["sent"]["outer_delta"] == 32 * calls  # one tag each


def test_a_restarted_island_enters_an_authenticated_job_and_ends_with_the_members(tmp_path):
    """A follower of island 1 is SIGKILLed after two rounds; the launcher restarts the island, whose new leader
    authenticates like every member (the job's key needs no trade) and enters at a round boundary: the state
    hand-over's operations and every later exchange are tagged under the new epochs' keys, and all four
    workers end with the same global model."""
    from test_elastic_islands import _cfg, _kill_after_two_rounds, _records, _run

    run = tmp_path / "run"
    cfg = _cfg(tmp_path, max_restarts=1, authenticate_payloads=True)
    code, log = _run(cfg, run, _kill_after_two_rounds(tmp_path / "HOLD", 3, "i1w0.1"))
    assert code == 0, log
    assert "restarting island 1 (restart 1 of 1)" in log, log
    recs = _records(run)
    assert set(recs) == {"i0w0", "i0w1", "i1w0.1", "i1w1.1"}, log
    assert len({r["global_sha256"] for r in recs.values()}) == 1, {n: r["global_sha256"] for n, r in recs.items()}
    syncs = recs["i1w0.1"]["syncs"]
    assert any(s["kind"] == "outer_delta" and s["size"] == 2 for s in syncs), syncs  # the joiner exchanged, tagged


# ---- a refused payload in a whole job: the receiver leaves, the others go on --------------------------------
# `islands run --elastic` of a small DiLoCo program whose w0 has something on its network path that flips one bit
# of w1's contribution to one outer exchange (a wrapper in front of w0's check, as Tamper above).
TAMPERED_JOB = r"""
import json, os, sys
from pathlib import Path
import torch, torch.nn as nn, torch.nn.functional as F
import islands
from islands.runtime.elastic import global_digest

out, name = Path(sys.argv[1]), os.environ["ISLANDS_NAME"]
out.mkdir(exist_ok=True)
world = islands.init_world()
islands.control.authenticate_payloads(world)
m = world.membership


class FlipOne:
    def __init__(self, tags):
        self.tags = tags

    def pack(self, t, fields):
        return self.tags.pack(t, fields)

    def open(self, packed, like, fields):
        kind, key, sender, receiver = fields
        if name == "w0" and sender == "w1" and kind == "outer_delta" and key == "e/0/s/3":
            packed = packed.clone()
            packed[0] ^= 1
        return self.tags.open(packed, like, fields)


m.comm.tags = FlipOne(m.comm.tags)
g = torch.Generator().manual_seed(0)
X = torch.randn(480, 16, generator=g)
Y = (X @ torch.randn(16, 4, generator=g)).argmax(-1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
strategy = islands.Stack(outer=islands.outer.DiLoCo(inner_steps=3))
model = strategy.wrap(model, opt, world)
shard, shards = world.shard
for step in range(world.start_step, 24):
    x, y = X[shard::shards][step * 8 % 150:][:8], Y[shard::shards][step * 8 % 150:][:8]
    F.cross_entropy(model(x), y).backward()
    strategy.after_backward(model, step)
    opt.step(); opt.zero_grad()
    strategy.after_step(model, opt, step)
strategy.finish(model)
(out / f"{name}.json").write_text(json.dumps({
    "sha": global_digest(strategy.eval_model(model)), "events": m.state_dict()["events"],
    "deltas": [[s["epoch"], s["seq"], s["size"]] for s in m.syncs if s["kind"] == "outer_delta"]}))
islands.close_world(world)
"""


def test_a_worker_that_refuses_a_payload_exits_1_with_one_line_and_the_others_finish_without_it(tmp_path):
    import json

    import harness.elastic as elastic_jobs

    out = tmp_path / "out"
    proc, err = elastic_jobs.start_job(tmp_path, TAMPERED_JOB, 3, "out")
    try:
        log = elastic_jobs.finish(proc, err, 240)
    finally:
        elastic_jobs.kill_job_processes(f"{tmp_path}/")
    logs = elastic_jobs.logs(tmp_path / "run")
    assert proc.returncode == 0, log + logs
    assert "worker w0 left (exit code 1); the others carry on" in log, log
    w0 = (tmp_path / "run" / "logs" / "w0.log").read_text()
    assert "islands: the outer_delta payload from member w1 (operation e/0/s/3, epoch 0) failed its MAC" in w0, w0
    assert "Traceback" not in w0, w0
    assert not (out / "w0.json").exists()
    recs = {n: json.loads((out / f"{n}.json").read_text()) for n in ("w1", "w2")}
    assert recs["w1"]["sha"] == recs["w2"]["sha"], "the others disagree on the global model"
    for r in recs.values():
        failures = [e for e in r["events"] if e["type"] == "failure"]
        assert [f["gone"] for f in failures] == [["w0"]], failures
        # the refused exchange never committed in epoch 0: it was retried by w1 and w2 in epoch 1, tagged anew
        assert [d for d in r["deltas"] if d[0] == 0] == [[0, 1, 3], [0, 2, 3]], r["deltas"]
        assert r["deltas"][2][0] > 0 and r["deltas"][2][2] == 2, r["deltas"]


class CorruptThenFail:
    """A process group whose collectives scribble over their tensors and then fail (a peer dying mid-transfer)."""

    def __init__(self, pg):
        self.pg = pg

    def __getattr__(self, name):
        return getattr(self.pg, name)

    def _broken(self, tensors):
        for t in tensors if isinstance(tensors[0], torch.Tensor) else tensors[0]:
            t.fill_(999)
        raise RuntimeError("Connection closed by peer (test)")

    def allreduce(self, tensors, opts=None):
        self._broken(tensors)

    def broadcast(self, tensors, opts=None):
        self._broken(tensors)

    def allgather(self, outs, tensors):
        self._broken(outs)


OPS = {
    "all_reduce": (lambda comm: comm.all_reduce(torch.tensor([5.0])).item(), 5.0),
    "all_gather": (lambda comm: [t.tolist() for t in comm.all_gather(torch.tensor([6.0]))], [[6.0]]),
    "broadcast": (lambda comm: comm.broadcast(torch.tensor([7.0])).item(), 7.0),
}


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("authenticate", [False, True], ids=["plain", "tagged"])
def test_a_member_left_alone_by_a_failed_operation_keeps_its_own_input(authenticate, op):
    """b leaves after the first operation, and a's next attempt fails having written into its buffers: a re-forms
    alone, and the operation's result is a's own input (the one-member sum, gather or broadcast)."""
    run, expected = OPS[op]

    def body(comm, i):
        first = comm.all_reduce(torch.tensor([1.0 + i])).item()
        if comm.name == "b":
            raise RuntimeError("b leaves")
        import time

        time.sleep(1.5)  # b's dead flag is up before a tries
        comm.epochs.pg = CorruptThenFail(comm.epochs.pg)
        return first, run(comm), comm.size

    results, errors = _members(body, names=("a", "b"), authenticate=authenticate)
    assert set(errors) == {"b"}, errors
    first, got, size = results["a"]
    assert first == 3.0 and size == 1
    assert got == expected
