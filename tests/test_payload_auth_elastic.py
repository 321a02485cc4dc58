"""Authenticated payloads in elastic jobs (ElasticComm.authenticate): every tensor an operation sends is tagged
under the job's key and the operation's e/<epoch>/s/<seq>, checked by each receiver before its ok. In-process
members (threads over a real job store and gloo) for the collectives and for what a receiver refuses; whole
`islands train --elastic` jobs for the end-to-end results."""

from __future__ import annotations

import threading

import pytest
import torch

from islands.runtime import membership
from islands.runtime.comm import CommLedger
from islands.runtime.elastic import ElasticComm
from islands.runtime.membership import Coordinator, JobSpec, host_store, join_job
from islands.runtime.payload_auth import PayloadAuthError

TOKEN = "the-elastic-job-secret"
NAMES = ("a", "b", "c")


def _members(body, names=NAMES, token_of=lambda name: TOKEN) -> tuple[dict, dict]:
    """Run `body(comm, index)` on one thread per member of a fresh job (each member authenticated with
    `token_of(name)`); returns ({name: body's result}, {name: the exception it raised}). A member that raises
    leaves as a worker does (close_world: heartbeat stopped, dead flag set), so the others can go on."""
    server, raw = host_store(0)
    coord = Coordinator(raw, TOKEN, JobSpec(workers=len(names), heartbeat_timeout=1.0, timeout=10.0)).start()
    sessions = [join_job("127.0.0.1", server.port, n, TOKEN) for n in names]
    results, errors = {}, {}

    def member(i, s):
        comm = ElasticComm(s.store, s.auth.sender, CommLedger(), heartbeat_timeout=1.0, collective_timeout=10.0)
        comm.job = s.job
        comm.heartbeat = membership.Heartbeat("127.0.0.1", server.port, s.auth.sender, auth=s.auth,
                                              new_client=s.new_client)
        try:
            comm.form(0, None)
            comm.authenticate(token_of(s.auth.sender))
            results[s.auth.sender] = body(comm, i)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors[s.auth.sender] = e
        finally:
            comm.leave()

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
        out = {"sum": comm.all_reduce(torch.arange(4.0) * (r + 1)).tolist(),
               "max": comm.all_reduce(torch.tensor([r, -r], dtype=torch.int64),
                                      op=torch.distributed.ReduceOp.MAX).tolist(),
               "gather": [t.tolist() for t in comm.all_gather(torch.full((2, 2), r, dtype=torch.bfloat16))],
               "bcast": comm.broadcast(torch.full((3,), float(r)), src=1).tolist(),
               "objects": comm.all_gather_object({"name": comm.name})}
        ring = lambda rank, size: ({(rank + 1) % size: torch.full((2,), float(rank))}, [(rank - 1) % size])
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
        failures = [e for e in comm.events if e["type"] == "failure"]
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
    for name, own in (("b", 2.0), ("c", 3.0)):
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
