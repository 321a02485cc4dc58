"""A served participant's joins (the parameter server in an elastic job; contracts.ServedParticipant, ServedEnd):
members admit nobody at round boundaries, a joiner enters at the step the participant names without waiting for
anyone, and at the end the members put the joiners that finished into one last epoch, after the service's final
answer, or, with no member left alive, the joiners form it themselves. One process, the job's store in a dict; epochs
are recorded, not formed (the process tests are tests/integration/outer/test_ps_elastic.py and
test_ps_elastic_all_restart.py)."""

from __future__ import annotations

import json

import pytest

from harness.dict_store import DictStore
from harness.participants import Served
from islands.runtime.comm import CommLedger
from islands.runtime.contracts import ServedParticipant
from islands.runtime.elastic import JobEnded, Membership, admission, elastic_member


def _membership(
    store: DictStore, outer: Served, name: str, epoch: int, heartbeat_timeout: float = 3.0
) -> tuple[Membership, list]:
    comm = elastic_member(store, name, CommLedger(), heartbeat_timeout=heartbeat_timeout)
    comm.participate(outer)
    if epoch >= 0:
        comm.epochs.epoch, comm.epochs.members = epoch, [[0, "w0", 0], [1, "w1", 1]]
    formed: list = []
    comm.epochs.abort = lambda: None
    comm.epochs.form = lambda e, members: formed.append((e, None if members is None else [m[1] for m in members]))
    comm.transfer.global_sha = lambda strategy, model: "digest"
    return comm, formed


def test_members_admit_nobody_at_round_boundaries_and_the_finished_joiners_at_the_end():
    store, outer = DictStore(), Served()
    assert isinstance(outer, ServedParticipant)
    member, formed = _membership(store, outer, "w0", 0)
    store.set("pending", json.dumps([[2, "j1", 2]]))
    store.set("ready/j1", "1")
    member.at_step(outer, None, step=4)
    for rounds in (1, 2, 3):  # each island's rounds are its own: no boundary the members share
        outer.rounds = rounds
        member.at_step(outer, None, step=4 * rounds + 1)
    assert formed == [] and not [k for k in store.kv if k.startswith("round/")]
    finals: list = []
    member.end_served(lambda: finals.append(formed[:]) or {"version": 7, "pushes": 3})
    assert finals == [[]]  # the service's final answer came before any epoch formed
    assert formed == [(1, ["w0", "w1", "j1"])] and json.loads(store.get("end/join")) == [[2, "j1", 2]]
    assert json.loads(store.get("joinat/j1"))["epoch"] == 1
    end = next(e for e in member.events if e["type"] == "served_end")
    assert end["version"] == 7 and end["pushes"] == 3
    assert next(e for e in member.events if e["type"] == "join")["via"] == "end"


def test_a_joiner_enters_at_its_own_step_at_once_and_is_ready_before_its_final_answer():
    store, outer = DictStore(), Served(step=12)
    joiner, formed = _membership(store, outer, "j1", -1)
    assert joiner.enter(outer, None) == 12  # no joinat/j1 exists: it waited for nobody
    entered = joiner.events[-1]
    assert entered["type"] == "entered" and entered["via"] == "service" and entered["step"] == 12
    assert not store.check(["ready/j1"]) and formed == []  # not proposed while it trains
    seen: list = []

    def final() -> dict:
        seen.append(store.check(["ready/j1"]))
        store.set("joinat/j1", json.dumps({"epoch": 1, "holders": ["w0", "w1"]}))  # the members, after the answer
        return {"version": 7}

    joiner.end_served(final)
    assert seen == [True] and formed == [(1, None)]
    assert [e["type"] for e in joiner.events] == ["entered", "served_end", "entered"]


def test_with_no_joiner_the_end_forms_no_epoch():
    store, outer = DictStore(), Served()
    member, formed = _membership(store, outer, "w1", 0)
    member.end_served(lambda: {})
    assert formed == [] and json.loads(store.get("end/join")) == []


def _first_islands_dead(store: DictStore) -> None:
    """Epoch 0 of w0 and w1, both reported dead by the launcher; w1.1 and w0.1 (their restarts) admitted joiners."""
    store.set("e/0/members", json.dumps([[0, "w0", 0], [1, "w1", 1]]))
    store.set("dead/w0", "killed")
    store.set("dead/w1", "killed")
    store.set("pending", json.dumps([[2, "w1.1", 1], [3, "w0.1", 0]]))


def test_with_no_member_alive_the_joiners_that_finished_form_the_last_epoch_themselves(monkeypatch):
    monkeypatch.setattr(admission, "ADMIT_LINGER_S", 0.0)
    store, outer = DictStore(), Served()
    _first_islands_dead(store)
    first, formed = _membership(store, outer, "w1.1", -1, heartbeat_timeout=0.1)
    store.set("ready/w0.1", "1")  # the other joiner trained to the end too: ready before its final answer
    first.end_served(lambda: {"version": 9})
    # nobody was left to put it in: the joiners agreed among themselves, under the members' key, on the next epoch
    assert formed == [(1, ["w1.1", "w0.1"])], formed
    assert json.loads(store.get("end/join")) == [[2, "w1.1", 1], [3, "w0.1", 0]] and store.get("end/epoch") == b"1"
    entered = first.events[-1]
    assert entered["type"] == "entered" and entered["via"] == "end" and entered["without_members"]
    # had w0.1 been counted gone while w1.1 formed that epoch (and written run.json as its rank 0, then finished),
    # w0.1 coming back later asks for the same epoch, which was formed without it (Epochs.form: Excluded), and
    # never forms another one whose rank 0 would write run.json again
    store.set("latest", "1")
    store.set("e/1/members", json.dumps([[2, "w1.1", 1]]))
    store.set("dead/w1.1", "finished")
    second, formed = _membership(store, outer, "w0.1", -1, heartbeat_timeout=0.1)
    second.end_served(lambda: {"version": 9})
    assert formed == [(1, ["w1.1", "w0.1"])], formed


def test_a_joiner_left_out_of_the_last_epoch_ends_with_job_ended(monkeypatch):
    """The end was made without it (by the members, or by joiners before it was ready): it is not made again."""
    monkeypatch.setattr(admission, "ADMIT_LINGER_S", 0.0)
    store, outer = DictStore(), Served()
    _first_islands_dead(store)
    store.set("end/join", json.dumps([[2, "w1.1", 1]]))  # agreed before w0.1 was ready
    late, formed = _membership(store, outer, "w0.1", -1, heartbeat_timeout=0.1)
    with pytest.raises(JobEnded, match="formed without this worker"):
        late.end_served(lambda: {"version": 9})
    assert formed == [] and not store.check(["end/epoch"])


def test_while_a_member_lives_the_joiner_waits_for_it_to_put_it_in(monkeypatch):
    monkeypatch.setattr(admission, "ADMIT_LINGER_S", 0.0)
    store, outer = DictStore(), Served()
    _first_islands_dead(store)
    store.kv.pop("dead/w1")
    joiner, formed = _membership(store, outer, "w1.1", -1, heartbeat_timeout=30.0)

    def final() -> dict:  # w1 is alive (its beats are not stale) and puts the joiner in after the answer
        store.set("hb/w1", "1")
        store.set("joinat/w1.1", json.dumps({"epoch": 1, "holders": ["w1"]}))
        return {"version": 9}

    joiner.end_served(final)
    assert formed == [(1, None)] and not store.check(["end/join"])
