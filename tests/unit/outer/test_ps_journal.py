"""The parameter server's durable shard (issue #36, part 2): a shard dropped at any point (as a SIGKILL leaves it:
no close, no flush beyond what each push fsynced) is rebuilt from its snapshot and log with every acknowledged push,
bit for bit; a torn last record is cut off; a push sent again after a lost answer is applied once."""

from __future__ import annotations

import pytest
import torch

from islands.outer import DelayedNesterov, OuterSGD
from islands.sync.outer.ps_journal import DurableShard, Journal
from islands.sync.outer.ps_server import Contribution, ServerState


def build(path=None, commit_every: int = 3, quorum: int = 1) -> DurableShard:
    torch.manual_seed(0)
    state = ServerState(torch.randn(7), lambda: DelayedNesterov(0.7, 0.9, buffer=2), shards=2, quorum=quorum)
    return DurableShard(state, None if path is None else Journal(path, commit_every))


def pushes(n: int) -> list[tuple[int, int, Contribution]]:
    """(island, seq, contribution): two islands, each numbering its own pushes from 1."""
    g = torch.Generator().manual_seed(1)
    out, seqs = [], {0: 0, 1: 0}
    for i in range(n):
        island = i % 2
        seqs[island] += 1
        out.append((island, seqs[island], Contribution(island, max(0, i - 1), torch.randn(7, generator=g), 1.0 + i)))
    return out


def same(a: DurableShard, b: DurableShard) -> None:
    assert a.state.version == b.state.version and a.state.counts == b.state.counts
    assert torch.equal(a.state.pull()[1], b.state.pull()[1])
    assert a.applied == b.applied
    for ra, rb in zip(a.state.rules, b.state.rules):
        sa, sb = ra.state_dict(), rb.state_dict()
        assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"]) and sa["count"] == sb["count"]


@pytest.mark.parametrize("killed_after", [2, 3, 7])  # mid-segment, right after a commit, several segments in
def test_a_killed_shard_is_rebuilt_with_every_acknowledged_push(tmp_path, killed_after):
    reference = build()
    journaled = build(tmp_path)
    journaled.open()
    for island, seq, c in pushes(10)[:killed_after]:
        reference.push(island, 7, seq, c, 2)
        journaled.push(island, 7, seq, c, 2)  # acknowledged: logged and fsynced before this returns
    del journaled  # killed: nothing closed
    rebuilt = build(tmp_path)
    rebuilt.open()
    same(rebuilt, reference)
    assert rebuilt.restarts == 1 and len(list(tmp_path.glob("log.*"))) == 1  # old segments deleted at each commit
    for island, seq, c in pushes(10)[killed_after:]:  # and it continues as if nothing happened
        assert rebuilt.push(island, 7, seq, c, 2) == reference.push(island, 7, seq, c, 2)
    same(rebuilt, reference)


def test_a_record_torn_by_the_kill_is_cut_and_the_rest_kept(tmp_path):
    shard = build(tmp_path, commit_every=100)
    shard.open()
    for island, seq, c in pushes(3):
        shard.push(island, 7, seq, c, 2)
    log = tmp_path / "log.0"
    whole = log.stat().st_size
    with open(log, "ab") as f:  # a fourth record, killed half way through its write (never answered)
        f.write(b"\x40\x00\x00\x00\x00\x00\x00\x00\x01\x02\x03\x04partial")
    rebuilt = build(tmp_path, commit_every=100)
    assert rebuilt.open() == 3
    same(rebuilt, shard)
    assert log.stat().st_size == whole  # the torn bytes are gone: the next append starts on a clean record


def test_a_push_sent_again_after_a_lost_answer_is_applied_once(tmp_path):
    shard = build(tmp_path)
    shard.open()
    (island, seq, c), second = pushes(2)
    ack, duplicate = shard.push(island, 7, seq, c, 2)
    assert ack.accepted and not duplicate
    version, model = shard.state.pull()
    rebuilt = build(tmp_path)  # the server died before its answer reached the island, which sends it again
    rebuilt.open()
    again, duplicate = rebuilt.push(island, 7, seq, c, 2)
    assert duplicate and again.accepted and again.version == version
    assert torch.equal(rebuilt.state.pull()[1], model) and rebuilt.state.counts["pushes"] == 1
    assert rebuilt.duplicates == 1 and shard.duplicates == 0  # the server report's count (ps_report.py)
    # the same number from a restarted island process (another nonce) is a new push
    assert not rebuilt.push(island, 8, seq, c, 2)[1] and rebuilt.state.counts["pushes"] == 2


def test_a_window_settled_when_an_island_left_is_replayed(tmp_path):
    shard = build(tmp_path, commit_every=100, quorum=2)
    shard.open()
    island, seq, c = pushes(1)[0]
    assert not shard.push(island, 7, seq, c, 2)[0].stepped  # waits for a second island
    assert not shard.settle(2)  # nothing to do while both train
    assert shard.settle(1) and shard.state.version == 1  # the other left: the window steps without it
    rebuilt = build(tmp_path, commit_every=100, quorum=2)
    rebuilt.open()
    same(rebuilt, shard)


def test_a_restore_is_committed_at_once(tmp_path):
    source = build()
    for island, seq, c in pushes(5):
        source.push(island, 7, seq, c, 2)
    shard = build(tmp_path, commit_every=100)
    shard.open()
    shard.restore(source.state_dict())
    rebuilt = build(tmp_path, commit_every=100)
    rebuilt.open()
    # the source moved away from a fresh shard, so only a journal that committed the restore gives it back
    assert source.state.version > 0 and not torch.equal(source.state.pull()[1], build().state.pull()[1])
    assert rebuilt.state.version == source.state.version
    same(rebuilt, source)


def test_bad_journal_settings_name_themselves(tmp_path):
    with pytest.raises(ValueError, match="commit_every"):
        Journal(tmp_path, commit_every=0)
    state = ServerState(torch.zeros(3), lambda: OuterSGD(1.0), shards=3)
    with pytest.raises(ValueError, match="shards"):
        DurableShard(ServerState(torch.zeros(3), lambda: OuterSGD(1.0))).load_state_dict(
            DurableShard(state).state_dict()
        )
