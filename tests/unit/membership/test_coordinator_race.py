"""Admission stays correct with more than one coordinator (issue #20 item 2): with a replicated store a deposed
leader may still be running when the next one starts, and a new leader must finish what the dead one began.
Every decision of membership.Coordinator is a compare-and-set that can be re-made from the store, so two
coordinators racing on one store give every admitted process one slot, each name once, one epoch 0, and a
coordinator started after another stopped mid-handshake admits the process that answered the old challenge."""

from __future__ import annotations

import json
import threading
import time

import pytest

from islands.runtime.elastic.membership import (
    Coordinator,
    JobSpec,
    Refused,
    ask_to_join,
    connect,
    get_json,
    host_store,
    proof,
    wait_key,
)

TOKEN = "race-token"


def _coordinators(port: int, job: JobSpec, n: int) -> list[Coordinator]:
    first = Coordinator(connect("127.0.0.1", port), TOKEN, job, log=lambda _: None)
    job = first.job  # the job id the first one drew: every coordinator of a job shares it
    rest = [
        Coordinator(connect("127.0.0.1", port), TOKEN, job, log=lambda _: None, publish=False) for _ in range(n - 1)
    ]
    return [first, *rest]


def test_two_coordinators_racing_give_each_joiner_one_slot_and_agree_on_epoch_0():
    server, _ = host_store(0)
    coords = [c.start() for c in _coordinators(server.port, JobSpec(workers=3), 2)]
    results: dict[str, object] = {}

    def join(name: str, token: str = TOKEN, key: str | None = None) -> None:
        try:
            results[key or name] = ask_to_join(connect("127.0.0.1", server.port), name, token, timeout_s=30)
        except Refused as e:
            results[key or name] = e

    names = [f"n{i}" for i in range(6)]
    threads = [threading.Thread(target=join, args=(n,)) for n in names]
    threads += [
        threading.Thread(target=join, args=("n0", TOKEN, "n0-again")),
        threading.Thread(target=join, args=("mallory", "guess")),
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        admitted = {n: results[n] for n in names + ["n0-again"] if not isinstance(results.get(n), Refused)}
        refused = {n: str(r) for n, r in results.items() if isinstance(r, Refused)}
        # "n0" twice: exactly one of the two tickets holds the name, the other is refused as taken
        assert len(admitted) == 6 and list(refused).count("mallory") == 1, results
        assert any("already taken" in r for r in refused.values()) and "wrong token" in refused["mallory"]
        assert sorted(a.slot for a in admitted.values()) == list(range(6))  # one slot each, none twice
        assert {a.initial for a in admitted.values() if a.slot < 3} == {True}
        assert {a.initial for a in admitted.values() if a.slot >= 3} == {False}
        store = coords[0].store
        members = json.loads(wait_key(store, "e/0/members", 10, "epoch 0"))
        assert [m[0] for m in members] == [0, 1, 2] and [m[2] for m in members] == [0, 1, 2]
        deadline = time.monotonic() + 10
        while len(get_json(store, "pending", [])) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(p[0] for p in get_json(store, "pending", [])) == [3, 4, 5]
        for c in coords:
            c.stop()  # its poll thread refreshes too: two refreshes at once would append a slot twice
            c._refresh()
        assert coords[0].admitted == coords[1].admitted and len(coords[0].admitted) == 6
    finally:
        for c in coords:
            c.stop()


def test_a_coordinator_started_after_another_stopped_mid_handshake_admits_the_joiner():
    server, _ = host_store(0)
    (old,) = _coordinators(server.port, JobSpec(workers=1), 1)
    old.start()
    try:
        ask_to_join(connect("127.0.0.1", server.port), "w0", TOKEN)  # epoch 0 formed by the old one
        raw = connect("127.0.0.1", server.port)
        ticket = raw.add("join/tickets", 1)
        raw.set(f"join/{ticket}/name", "late")
        challenge = wait_key(raw, f"join/{ticket}/challenge", 10, "challenge").decode()
    finally:
        old.stop()  # it dies after issuing the challenge, before the proof arrives
    raw.set(f"join/{ticket}/proof", proof(TOKEN, "late", challenge))
    new = Coordinator(connect("127.0.0.1", server.port), TOKEN, old.job, log=lambda _: None, publish=False).start()
    try:
        assert json.loads(json.loads(wait_key(raw, f"join/{ticket}/verdict", 10, "verdict"))["verdict"]) == {
            "admitted": True,
            "slot": 1,
            "shard": 0,
            "initial": False,
        }
        deadline = time.monotonic() + 10
        while not new.formed and time.monotonic() < deadline:  # its poll writes the verdict, then re-reads epoch 0
            time.sleep(0.01)
        assert new.formed and [a[1] for a in new.admitted] == ["w0", "late"]
        with pytest.raises(Refused, match="already taken"):  # the name stays taken across coordinators
            ask_to_join(connect("127.0.0.1", server.port), "w0", TOKEN)
    finally:
        new.stop()
