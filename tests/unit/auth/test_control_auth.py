"""The authenticated control plane (issue #20 item 6): store values carry an HMAC under the job token; a
process without the token cannot forge, alter, move or replay one, nor admit itself, exclude a member, fake
a heartbeat, set an operation's verdict or redirect a process group's rendezvous."""

from __future__ import annotations

import datetime
import json
import threading
import time

import pytest
import torch
import torch.distributed as dist

from islands.runtime.comm import CommLedger
from islands.runtime.elastic import elastic_member, membership
from islands.runtime.elastic.auth import AuthStore, ControlAuth, mac_payload
from islands.runtime.elastic.membership import (
    Coordinator,
    JobSpec,
    Liveness,
    Refused,
    ask_to_join,
    connect,
    get_json,
    host_store,
    join_job,
)

TOKEN = "s3cret-token"


@pytest.fixture()
def job():
    server, raw = host_store(0)
    lines: list[str] = []
    coord = Coordinator(raw, TOKEN, JobSpec(workers=2, heartbeat_timeout=1.0, timeout=5.0), log=lines.append).start()
    yield server.port, coord, lines
    coord.stop()


def _attacker(port: int):
    """What a process without the token has: a plain client of the store, every key readable and writable."""
    return connect("127.0.0.1", port)


def test_envelopes_bind_key_sender_counter_and_scope():
    a = ControlAuth(TOKEN, "job-1", "w0")
    sealed = a.seal("e/1/members", '[[0, "w0", 0]]')
    sender, n, value = a.open("e/1/members", sealed)
    assert (sender, value) == ("w0", b'[[0, "w0", 0]]') and n > 0
    assert a.open("e/2/members", sealed) == "bad_mac"  # moved to another key
    assert ControlAuth(TOKEN, "job-2", "w0").open("e/1/members", sealed) == "bad_mac"  # another job, same token
    assert ControlAuth("guess", "job-1", "w0").open("e/1/members", sealed) == "bad_mac"  # another token
    assert a.open("e/1/members", b'[[0, "w0", 0]]') == "unsigned"
    assert a.open("e/1/members", sealed[:-1] + b"]]") != ("w0", n, value)  # changed value
    flipped = bytearray(sealed)
    flipped[-3] ^= 0x01  # one bit of the value
    assert a.open("e/1/members", bytes(flipped)) == "bad_mac"
    forged_sender = sealed.replace(b'"s": "w0"', b'"s": "w1"')
    assert a.open("e/1/members", forged_sender) == "bad_mac"
    assert a.open("e/1/members", b"isl1 {not json\n[]") == "malformed"
    assert a.open("k", a.seal("k", "x"))[1] < a.open("k", a.seal("k", "x"))[1]  # the counter only grows
    assert len(mac_payload(b"k" * 32, torch.arange(10, dtype=torch.float32))) == 32


def test_auth_store_refuses_forged_tampered_and_replayed_values_and_counts_them():
    server, raw = host_store(0)
    auth = ControlAuth(TOKEN, "j", "w0")
    writer, reader = AuthStore(raw, auth), AuthStore(raw, ControlAuth(TOKEN, "j", "w1"), timeout_s=0.3)
    outsider = _attacker(server.port)
    outsider.set("pending", '[[9, "mallory", 0]]')  # forged: unsigned
    assert not reader.check(["pending"]) and get_json(reader, "pending", []) == []
    with pytest.raises(RuntimeError, match="no authenticated value"):
        reader.get("pending")
    writer.set("latest", "1")
    old = outsider.get("latest")
    writer.set("latest", "2")
    assert reader.get("latest") == b"2"
    outsider.set("latest", old)  # a replay: the genuine earlier value written back
    assert reader.get("latest") == b"2" and reader.stats["replay"] == 1
    flipped = bytearray(outsider.get("latest"))
    flipped[-1] ^= 0x04  # tampered: one bit of the value
    outsider.set("latest", bytes(flipped))
    assert reader.get("latest") == b"2" and reader.stats["bad_mac"] == 1
    outsider.set("e/3/members", outsider.get("latest"))  # a genuine value moved to another key
    assert not reader.check(["e/3/members"])
    assert reader.stats["accepted"] == 1 and reader.stats["rejected"] == reader.stats["unsigned"] + 1 + 1 + 1
    assert reader.stats["unsigned"] >= 1


def test_compare_set_replaces_a_planted_value_and_one_honest_writer_still_wins():
    server, raw = host_store(0)
    outsider = _attacker(server.port)
    outsider.set("round/3/join", '[[9, "mallory", 0]]')  # planted before any member writes
    stores = [AuthStore(connect("127.0.0.1", server.port), ControlAuth(TOKEN, "j", f"w{i}")) for i in range(3)]
    results: list[bytes] = [b""] * 3

    def write(i):
        results[i] = stores[i].compare_set("round/3/join", "", json.dumps([[i, f"w{i}", i]]))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(set(results)) == 1 and b"mallory" not in results[0]  # exactly one genuine list, everyone agrees
    assert AuthStore(raw, ControlAuth(TOKEN, "j", "r")).get("round/3/join") == results[0]


def test_no_token_no_admission_and_forged_verdicts_are_not_believed(job):
    port, coord, lines = job
    with pytest.raises(Refused, match="wrong token"):
        ask_to_join(_attacker(port), "mallory", "guess")
    assert any("refused 'mallory'" in line for line in lines)
    # an attacker playing the coordinator for a genuine joiner: its challenge, then a forged admission
    coord.stop()
    outsider = _attacker(port)
    ticket = outsider.add("join/tickets", 0) + 1
    outsider.set(f"join/{ticket}/challenge", "c0ffee")
    outsider.set(
        f"join/{ticket}/verdict",
        json.dumps(
            {"verdict": json.dumps({"admitted": True, "slot": 0, "shard": 0, "initial": True}), "mac": "0" * 64}
        ),
    )
    with pytest.raises(Refused, match="does not verify"):
        ask_to_join(connect("127.0.0.1", port), "w0", TOKEN, timeout_s=1.0)
    assert coord.admitted == []


def test_a_tampered_job_record_is_refused_not_run(job):
    port, coord, lines = job
    outsider = _attacker(port)
    assert JobSpec.read(outsider, TOKEN).workers == 2  # a holder of the token reads it
    evil = JobSpec(workers=2, script=("/tmp/evil.py",)).to_json()
    outsider.set("job", evil)  # an unsigned record naming a script to run
    with pytest.raises(Refused, match="does not verify"):
        JobSpec.read(outsider, TOKEN, timeout_s=1.0)
    record = bytearray(coord.job.seal(TOKEN))
    record[record.index(b'"workers": 2') + 11] = ord("9")  # tampered genuine record
    outsider.set("job", bytes(record))
    with pytest.raises(Refused):
        JobSpec.read(outsider, TOKEN, timeout_s=1.0)


def test_forged_membership_writes_change_nothing_a_member_reads(job):
    port, coord, lines = job
    a, b = join_job("127.0.0.1", port, "a", TOKEN), join_job("127.0.0.1", port, "b", TOKEN)
    outsider = _attacker(port)
    live = Liveness(a.store, timeout_s=1.0)
    beat = membership.Heartbeat("127.0.0.1", port, "b", auth=b.auth, new_client=b.new_client)
    try:
        # a forged exclusion (dead flag), a forged joiner, a forged epoch and a forged "latest"
        outsider.set("dead/b", "killed")
        outsider.set("pending", '[[5, "mallory", 0]]')
        outsider.set("ready/mallory", "1")
        outsider.set("e/1/members", '[[0, "a", 0], [5, "mallory", 0]]')
        outsider.set("latest", "1")
        assert live.gone(["b"]) == set()
        assert get_json(a.store, "pending", []) == [] and not a.store.check(["ready/mallory", "e/1/members"])
        assert coord.latest_epoch() == 0
        # a stopped heartbeat kept "alive" by replaying its old beats: still silent past the timeout
        beat.stop()
        captured = outsider.get("hb/b")
        seen: set[str] = set()
        deadline = time.monotonic() + 1.6
        while time.monotonic() < deadline:
            outsider.set("hb/b", captured)
            outsider.add("hb/c", 1)
            seen |= live.gone(["b"])
            time.sleep(0.05)
        assert seen == {"b"}
    finally:
        beat.stop()
    assert a.snapshot()["rejected"] >= 5


def test_a_forged_verdict_does_not_commit_an_operation_and_a_forged_rendezvous_does_not_redirect_it(job):
    """Two members all-reduce through ElasticComm while an outsider plants "fail" verdicts and per-member oks for
    the operations ahead and overwrites the process group's rendezvous keys. Believed, either would force a
    fail-over to a new epoch; refused, the sums are right and the members stay in epoch 0 with no event."""
    port, coord, lines = job
    sessions = [join_job("127.0.0.1", port, n, TOKEN) for n in ("a", "b")]
    outsider = _attacker(port)
    for seq in range(6):
        for key in ("done", "ok/a", "ok/b"):
            outsider.set(f"e/0/s/{seq}/{key}", "fail" if key == "done" else "1")
    for rank in range(2):  # gloo's rendezvous: the peers' addresses
        outsider.set(f"pg/0/0/{rank}", b"\x00" * 64)
    results: dict[str, list] = {}
    errors: list = []

    def member(i, s):
        try:
            member = elastic_member(
                s.store, s.auth.sender, CommLedger(), heartbeat_timeout=5.0, collective_timeout=10.0
            )
            comm = member.comm
            member.epochs.form(0, None)
            out = []
            for k in range(3):
                out.append(comm.all_reduce(torch.tensor([float(i + 1) * (k + 1)])).item())
            results[s.auth.sender] = out + [comm.epoch, len(member.events)]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=member, args=(i, s)) for i, s in enumerate(sessions)]
    beats = [
        membership.Heartbeat("127.0.0.1", port, s.auth.sender, auth=s.auth, new_client=s.new_client) for s in sessions
    ]
    try:
        [t.start() for t in threads]
        [t.join(60) for t in threads]
    finally:
        for hb in beats:
            hb.stop()
    assert not errors, errors
    assert results == {"a": [3.0, 6.0, 9.0, 0, 0], "b": [3.0, 6.0, 9.0, 0, 0]}
    assert sum(s.snapshot()["rejected"] for s in sessions) > 0


def test_tickets_taken_without_a_name_do_not_hold_later_joiners(job, monkeypatch):
    # each forged ticket used to cost every joiner after it TICKET_NAME_WAIT: the patience is an hour here
    port, coord, lines = job
    monkeypatch.setattr(membership, "TICKET_NAME_WAIT", 3600.0)
    for _ in range(3):
        _attacker(port).add("join/tickets", 1)  # tickets nobody will ever name
    assert ask_to_join(connect("127.0.0.1", port), "w0", TOKEN, timeout_s=10.0).slot == 0
    assert sorted(coord.nameless) == [1, 2, 3]  # still watched, skipped in time; ticket 4 was w0's


def test_a_flood_of_forged_tickets_is_cut_and_a_joiner_still_gets_in(job, monkeypatch):
    port, coord, lines = job
    monkeypatch.setattr(membership, "NAMELESS_MAX", 16)
    _attacker(port).add("join/tickets", 200)  # a whole flood at once
    assert ask_to_join(connect("127.0.0.1", port), "w0", TOKEN, timeout_s=10.0).slot == 0
    assert len(coord.nameless) <= 16


def test_a_coordinator_taking_over_starts_at_the_settled_floor(job, monkeypatch):
    """join/floor: below it every ticket is answered or skipped; a new coordinator (a seat taking the lease)
    starts there instead of re-reading every ticket of the job, and still answers the next joiner."""
    port, coord, lines = job
    monkeypatch.setattr(membership, "TICKET_NAME_WAIT", 0.2)
    _attacker(port).add("join/tickets", 1)  # ticket 1: never named, skipped
    assert ask_to_join(connect("127.0.0.1", port), "w0", TOKEN, timeout_s=10.0).slot == 0  # ticket 2
    raw = connect("127.0.0.1", port)
    reader = AuthStore(connect("127.0.0.1", port), ControlAuth(TOKEN, coord.job.job_id, "r"))
    deadline = time.monotonic() + 10
    while not (reader.check(["join/floor"]) and int(reader.get("join/floor")) == 3):
        assert time.monotonic() < deadline, coord.floor
        time.sleep(0.05)
    coord.stop()

    def take_over(joiner: str) -> tuple[int, set[int]]:
        """A new coordinator on the job's store admits `joiner`; its slot and the tickets whose keys it read."""
        looked: list[str] = []

        class Watched:  # the raw view, recording the keys it checks
            def __getattr__(self, name):
                return getattr(raw, name)

            def check(self, keys):
                looked.extend(keys)
                return raw.check(keys)

        new = Coordinator(Watched(), TOKEN, coord.job, log=lines.append, publish=False).start()
        try:
            slot = ask_to_join(connect("127.0.0.1", port), joiner, TOKEN, timeout_s=10.0).slot
        finally:
            new.stop()
        return slot, {int(k.split("/")[1]) for k in looked if k.startswith("join/") and k.split("/")[1].isdigit()}

    assert take_over("w1") == (1, {3})  # ticket 3: nothing below the floor was read again
    # a floor written without the token (here: past every ticket) is not believed: the next coordinator reads
    # from the first ticket again (slower, as before the floor existed) and skips no joiner
    _attacker(port).set("join/floor", "999")
    slot, tickets = take_over("w2")
    assert slot == 2 and min(tickets) == 1 and 4 in tickets


def test_gloo_rendezvous_through_an_auth_store_waits_out_a_planted_address():
    server, raw = host_store(0)
    outsider = _attacker(server.port)
    outsider.set("pg/9/0/1", b"\x01" * 40)  # planted before rank 1 publishes its own address
    outcome: dict[int, float] = {}

    def rank(r):
        s = AuthStore(connect("127.0.0.1", server.port), ControlAuth(TOKEN, "j", f"r{r}"))
        pg = dist.ProcessGroupGloo(dist.PrefixStore("pg/9", s), r, 2, datetime.timedelta(seconds=20))
        t = torch.tensor([float(r + 1)])
        pg.allreduce([t]).wait()
        outcome[r] = t.item()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    threads[0].start()
    time.sleep(0.3)
    threads[1].start()
    [t.join(60) for t in threads]
    assert outcome == {0: 3.0, 1: 3.0}


def test_a_replayed_beat_read_after_a_pause_does_not_make_a_live_member_look_silent(job):
    """A member reads peers' beats only while it exchanges. If its first look after a long round finds an
    older beat written back (or a forged one), it reads its last genuine value again: that must not count
    as "unchanged for longer than the timeout". Only looks that find genuine values do; a peer whose beats
    cannot be seen at all for longer than the timeout counts as silent (the denial of service that is left)."""
    port, coord, lines = job
    a, b = join_job("127.0.0.1", port, "a", TOKEN), join_job("127.0.0.1", port, "b", TOKEN)
    outsider = _attacker(port)
    beat = membership.Heartbeat("127.0.0.1", port, "b", auth=b.auth, new_client=b.new_client)
    live = Liveness(a.store, timeout_s=1.0)
    try:
        assert live.silent(["b"]) == set()
        old = outsider.get("hb/b")
        time.sleep(1.5)  # a long round: no look
        outsider.set("hb/b", old)  # the store now holds the beat this reader saw 1.5 s ago: frozen, it seems
        assert live.silent(["b"]) == set()
        deadline = time.monotonic() + 5
        while outsider.get("hb/b") == old:  # b's next beat overwrites it: genuine progress again
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert live.silent(["b"]) == set() and a.store.fresh("hb/b")
        beat.stop()
        deadline = time.monotonic() + 1.6  # now every look finds a forged value for longer than the timeout
        seen = set()
        while time.monotonic() < deadline:
            outsider.set("hb/b", b"isl1 forged\n999")
            seen |= live.silent(["b"])
            time.sleep(0.02)
        assert seen == {"b"}
    finally:
        beat.stop()


def test_observe_gives_a_holder_of_the_token_the_members_view_and_refuses_a_wrong_token(job):
    port, coord, lines = job
    coord.store.set("e/0/members", json.dumps([[0, "a", 0]]))
    view = membership.observe(f"127.0.0.1:{port}", TOKEN)
    assert json.loads(view.get("e/0/members")) == [[0, "a", 0]]
    with pytest.raises(Refused, match="does not verify"):
        membership.observe(f"127.0.0.1:{port}", "not-the-token", timeout_s=2.0)
