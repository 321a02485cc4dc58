"""Shard 0's buffer table is as durable as its acknowledged pushes (issue #36): each island's buffer vector is logged
in its push's record, the table is in every commit and in SNAPSHOT / RESTORE. So a shard 0 dropped as a SIGKILL
leaves it (nothing closed) and rebuilt from its journal, or a service resumed from its checkpoint, answers with the
buffer mean it gave before, bit for bit; a push sent again is not kept twice; a model without buffers writes the
records it wrote before, and a journal written before buffers were journaled loads as an empty table."""

from __future__ import annotations

import time

import pytest
import torch
from test_ps_buffers import LAYOUT, as_held, bn_model, mean_of, remote, service
from test_ps_journal import build as plain_shard, pushes, same
from test_ps_service import config, until

from harness.ps import ThreadService
from islands.sync.outer.flat import FlatView
from islands.sync.outer.ps import outer_rule
from islands.sync.outer.ps_buffers import BufferTable, IslandBuffers
from islands.sync.outer.ps_journal import DurableShard, Journal
from islands.sync.outer.ps_link import Message
from islands.sync.outer.ps_server import Contribution
from islands.sync.outer.ps_service import ServiceConfig
from islands.sync.outer.ps_wire import DONE, PULL, PUSH

NUMEL = sum(LAYOUT)
# the fields of a push's record before buffers were journaled: a model without buffers still writes exactly these
PLAIN_RECORD = {"k", "island", "nonce", "seq", "version", "samples", "delta", "active"}


def shard0(path=None, commit_every: int = 3) -> DurableShard:
    """test_ps_journal's shard (7 values, 2 slices, delayed Nesterov) holding a buffer table of LAYOUT."""
    plain = plain_shard(path, commit_every)
    return DurableShard(plain.state, plain.journal, BufferTable(LAYOUT))


def vectors(n: int) -> list[torch.Tensor]:
    """The buffer vector of each push: floating statistics, then a count that grows with the push."""
    g = torch.Generator().manual_seed(2)
    floating = [torch.randn(LAYOUT[0], generator=g, dtype=torch.float64) for _ in range(n)]
    return [torch.cat([f, torch.tensor([3.0 * i], dtype=torch.float64)]) for i, f in enumerate(floating)]


def same_table(a: DurableShard, b: DurableShard) -> None:
    assert a.buffers is not None and b.buffers is not None
    assert sorted(a.buffers.latest) == sorted(b.buffers.latest)
    assert all(torch.equal(a.buffers.latest[i], b.buffers.latest[i]) for i in a.buffers.latest)
    ma, mb = a.buffers.mean(), b.buffers.mean()
    assert ma is not None and mb is not None and torch.equal(ma, mb)


# ---- the durable shard (no server) ---------------------------------------------------------------------------
@pytest.mark.parametrize("killed_after", [2, 3, 7])  # mid-segment, right after a commit, several segments in
def test_a_killed_shard_0_is_rebuilt_with_every_acknowledged_pushs_buffers(tmp_path, killed_after):
    reference, journaled = shard0(), shard0(tmp_path)
    journaled.open()
    both = list(zip(pushes(10), vectors(10)))
    for (island, seq, c), v in both[:killed_after]:
        reference.push(island, 7, seq, c, 2, v)
        journaled.push(island, 7, seq, c, 2, v)  # acknowledged: the push and its buffers fsynced in one record
    del journaled  # killed: nothing closed
    rebuilt = shard0(tmp_path)
    rebuilt.open()
    same(rebuilt, reference)
    same_table(rebuilt, reference)
    for (island, seq, c), v in both[killed_after:]:  # and it goes on as if nothing happened, answer for answer
        assert rebuilt.push(island, 7, seq, c, 2, v) == reference.push(island, 7, seq, c, 2, v)
        same_table(rebuilt, reference)


def test_a_push_sent_again_keeps_the_buffers_it_came_with_once(tmp_path):
    shard = shard0(tmp_path)
    shard.open()
    ((i0, s0, c0), (i1, s1, c1)), (v0, v1) = pushes(2), vectors(2)
    shard.push(i0, 7, s0, c0, 2, v0)
    shard.push(i1, 7, s1, c1, 2, v1)
    mean = shard.buffers.mean()
    rebuilt = shard0(tmp_path)  # the server died before island 1's answer arrived; the island sends it again
    rebuilt.open()
    records = rebuilt.journal.records
    # (another vector here only to show nothing of the resend is kept: a real resend carries the same bytes)
    _, duplicate = rebuilt.push(i1, 7, s1, c1, 2, v1 * 3)
    assert duplicate and rebuilt.journal.records == records
    assert torch.equal(rebuilt.buffers.latest[i1], v1) and torch.equal(rebuilt.buffers.mean(), mean)


def test_a_model_without_buffers_writes_the_records_it_wrote_before(tmp_path):
    shard = plain_shard(tmp_path, commit_every=3)
    shard.open()
    for island, seq, c in pushes(5):
        shard.push(island, 7, seq, c, 2)
    shard.close()
    saved, records = Journal(tmp_path).recover()
    assert saved is not None and set(saved) == {"server", "applied"}
    assert len(records) == 2 and all(set(r) == PLAIN_RECORD for r in records)
    # with a table, each record holds the vector and nothing else more
    with_buffers = shard0(tmp_path / "bn")
    with_buffers.open()
    (island, seq, c), v = pushes(1)[0], vectors(1)[0]
    with_buffers.push(island, 7, seq, c, 2, v)
    with_buffers.close()
    _, (record,) = Journal(tmp_path / "bn").recover()
    assert set(record) == PLAIN_RECORD | {"buffers"} and torch.equal(record["buffers"], v)


def test_a_journal_written_before_buffers_were_journaled_loads_as_an_empty_table(tmp_path):
    old = plain_shard(tmp_path, commit_every=3)  # what the shard wrote before: no buffers in records or snapshot
    old.open()
    for island, seq, c in pushes(5):  # a commit after 3, then 2 records
        old.push(island, 7, seq, c, 2)
    del old
    rebuilt = shard0(tmp_path)
    assert rebuilt.open() == 2
    reference = plain_shard()
    for island, seq, c in pushes(5):
        reference.push(island, 7, seq, c, 2)
    same(rebuilt, reference)
    assert rebuilt.buffers is not None and rebuilt.buffers.latest == {} and rebuilt.buffers.mean() is None
    (island, seq, c), v = pushes(6)[5], vectors(6)[5]
    rebuilt.push(island, 7, seq, c, 2, v)  # the next push fills it
    assert torch.equal(rebuilt.buffers.mean(), v)


def test_a_wrong_buffer_vector_is_refused_before_it_is_logged_and_another_layout_is_not_restored(tmp_path):
    shard = shard0(tmp_path)
    shard.open()
    island, seq, c = pushes(1)[0]
    with pytest.raises(ValueError, match="pushed 8 buffer values to a server of 9"):
        shard.push(island, 7, seq, c, 2, torch.zeros(8, dtype=torch.float64))
    assert shard.journal.records == 0 and shard.state.version == 0
    shard.push(island, 7, seq, c, 2, vectors(1)[0])
    other = DurableShard(plain_shard().state, None, BufferTable((4, 1)))
    with pytest.raises(ValueError, match="another model"):
        other.load_state_dict(shard.state_dict())
    with pytest.raises(ValueError, match="holds buffers, this server none"):
        plain_shard().load_state_dict(shard.state_dict())


# ---- shard servers (threads of the test, harness.ps.ThreadService) -------------------------------------------
def trained_pair(svc: ThreadService):
    """Islands 0 and 1 of different data and round lengths, 4 steps each: 4 pushes reach shard 0."""
    a, b = remote(svc, 0, h=2), remote(svc, 1, h=2)
    for i in range(4):
        a.step(i)
        b.step(i)
    return a, b, mean_of([a.pushed[-1], b.pushed[-1]])


# 4 push records: the table from the commit alone (2), a commit and a record after it (3), the log alone (64)
@pytest.mark.parametrize("commit_every", [2, 3, 64])
def test_a_rebuilt_shard_0_answers_a_joiner_with_the_buffer_mean_it_held(tmp_path, commit_every):
    torch.set_num_threads(1)
    with service(tmp_path, commit_every=commit_every) as svc:
        a, b, expected = trained_pair(svc)
        assert torch.equal(svc.servers[0].buffers.mean(), expected)
        version = svc.servers[0].durable.state.version
        svc.restart(0, [a.strategy.link, b.strategy.link])
        assert (tmp_path / "shard0" / "snapshot.pt").exists() == (commit_every <= 4)
        assert svc.servers[0].durable.restarts == 1 and svc.servers[0].durable.state.version == version
        late = remote(svc, 2)
        ((shared, holds),) = late.adopted  # its first pull, answered by the rebuilt shard 0
        assert shared is not None and torch.equal(shared, expected)
        assert torch.equal(holds, as_held(expected))
        a.step(4)
        a.step(5)  # and a's next push is answered as the shard that never died would have
        assert torch.equal(a.adopted[-1][0], mean_of([a.pushed[-1], b.pushed[-1]]))


def test_a_resumed_service_answers_with_the_buffers_of_its_checkpoint(tmp_path):
    """SNAPSHOT (island 0's checkpoint, `ps_shards`) holds the table; RESTORE on new servers gives it back and
    commits it, so the first pull of the resumed job brings the islands' mean, and a rebuild after it too."""
    torch.set_num_threads(1)
    with service(tmp_path / "first") as first:
        _, _, expected = trained_pair(first)
        states = first.link(9, buffers=NUMEL).snapshot()
    with service(tmp_path / "second") as second:
        island0 = second.link(9, buffers=NUMEL)
        island0.restore(states)
        late = remote(second, 2)
        ((shared, holds),) = late.adopted
        assert shared is not None and torch.equal(shared, expected) and torch.equal(holds, as_held(expected))
        second.restart(0, [island0, late.strategy.link])
        assert torch.equal(second.servers[0].buffers.mean(), expected)


def test_a_push_sent_again_to_shard_0_does_not_change_the_buffer_mean(tmp_path):
    torch.set_num_threads(1)
    with service(tmp_path) as svc:
        n = svc.config.bounds[-1][1]
        a, b = svc.link(0, buffers=NUMEL), svc.link(1, buffers=NUMEL)
        va, vb = vectors(3)[1:]
        a.send(Message(PULL, 0))
        b.send(Message(PULL, 1))
        a.send(Message(PUSH, 0, 0, 1.0, torch.zeros(n), va))
        reply = b.send(Message(PUSH, 1, 0, 1.0, torch.zeros(n), vb))
        assert reply.buffers is not None and torch.equal(reply.buffers, mean_of([va, vb]))
        b.seq -= 1  # the same push number again, as a resend after a lost answer (another vector: see it unkept)
        again = b.send(Message(PUSH, 1, 0, 1.0, torch.zeros(n), vb * 3))
        assert svc.servers[0].durable.duplicates == 1 and torch.equal(again.buffers, reply.buffers)
        svc.restart(0, [a, b])
        pulled = a.send(Message(PULL, 0))  # the rebuilt shard 0 (the resend was not journaled)
        assert pulled.buffers is not None and torch.equal(pulled.buffers, reply.buffers)


def test_a_shard_0_rebuilt_from_a_journal_without_buffers_answers_without_them_until_the_next_pushes(tmp_path):
    """A journal written before buffers were journaled (as a table-less shard writes it): the rebuilt shard 0 holds
    the model but no island's statistics; a joiner's pull leaves its own buffers as they were, and the next pushes
    fill the table again."""
    torch.set_num_threads(1)
    initial = IslandBuffers(bn_model().buffers()).read()
    config = ServiceConfig(
        FlatView(bn_model().parameters()).read(), outer_rule(), islands=2, servers=2, lease_s=30.0, buffers=LAYOUT
    )
    for k, (lo, hi) in enumerate(config.bounds):  # a zero push to each shard, committed after 2, then a record
        old = DurableShard(config.shard_state(k), Journal(tmp_path / f"shard{k}", 2))
        old.open()
        for seq in (1, 2, 3):
            old.push(0, 7, seq, Contribution(0, seq - 1, torch.zeros(hi - lo), 1.0), 1)
        old.close()
    with ThreadService(tmp_path, config) as svc:
        deadline = time.monotonic() + 60.0
        while not all(s.gen for s in svc.servers):  # a server announces its generation once it has rebuilt
            assert time.monotonic() < deadline, "the servers did not start"
            time.sleep(0.02)
        assert [s.durable.state.version for s in svc.servers] == [3, 3]
        assert svc.servers[0].buffers is not None and not svc.servers[0].buffers.latest
        late = remote(svc, 2)
        ((shared, holds),) = late.adopted
        assert shared is None and torch.equal(holds, initial)  # its own: 0, 1, 0
        a = remote(svc, 0)
        a.step(0)
        a.step(1)  # a's push: only a's statistics there
        shared, holds = a.adopted[-1]
        assert torch.equal(shared, a.pushed[-1]) and torch.equal(holds, as_held(a.pushed[-1]))
        late.step(0)
        late.step(1)
        assert torch.equal(late.adopted[-1][0], mean_of([a.pushed[-1], late.pushed[-1]]))


def test_a_push_refused_after_the_final_answer_keeps_no_buffers_and_both_islands_end_on_one_mean(tmp_path):
    """test_ps_service's island that wakes after the final answer, with buffers: its refused push is not journaled,
    so it changes nothing a rebuild would not know either, and its DONE is answered with the same mean as the
    first final answer (before, its statistics went into the table and into its final answer alone)."""
    with ThreadService(tmp_path, config(islands=2, lease_s=2.0, buffers=LAYOUT)) as service:
        a, b = service.link(0, buffers=NUMEL), service.link(1, buffers=NUMEL)
        va, vb = vectors(2)
        b.send(Message(PULL, 1))
        b.stopping.set()  # b's heartbeat stands still: it lapses after the lease
        a.send(Message(PUSH, 0, 0, 1.0, torch.full((10,), 1.0), va))
        server = service.servers[0]
        until(lambda: server.members.state[1] == "lapsed")
        final_a = a.send(Message(DONE, 0))
        assert a.final and final_a.buffers is not None and torch.equal(final_a.buffers, va)
        late = b.send(Message(PUSH, 1, 0, 1.0, torch.full((10,), 5.0), vb))  # b wakes: refused
        assert not late.ack.accepted and torch.equal(late.buffers, va)
        final_b = b.send(Message(DONE, 1))
        assert b.final and torch.equal(final_b.flat, final_a.flat) and torch.equal(final_b.buffers, va)
