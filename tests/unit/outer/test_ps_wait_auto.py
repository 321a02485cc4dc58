"""`ps:quorum=M,wait=auto` (ps_wait.PacedWait): the server learns each island's turnaround (answer out -> next push
in) and a held window waits only for the islands due soon. The rule alone; then on the virtual clock, where a
schedule's every answer is deterministic: equal islands, an island late by its link each round (waited for, where a
short fixed wait loses it every window), an island 4x slower (not waited for); the shard servers of process mode."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_ps_service import config, push
from test_ps_wait import Islands

from harness.ps import ThreadService
from islands.outer import VirtualClock
from islands.sync.outer.ps_link import Message
from islands.sync.outer.ps_wait import FixedWait, JoinAlignment, PacedWait, window_wait
from islands.sync.outer.ps_wire import PULL


def test_turnarounds_decide_who_is_due_and_for_how_long():
    w = PacedWait(reach=0.35, margin=0.1, first=30.0)
    for island in (0, 1, 2):
        w.answered(island, 0.0)
    w.arrived(0, 10.0)  # fast: 10 s a round
    w.arrived(1, 12.8)  # its link adds 2.8 s a round
    w.arrived(2, 40.0)  # 4x slower
    for island in (0, 1):  # island 0's window held for island 1: both answered when it stepped
        w.answered(island, 12.8)
    w.answered(2, 40.0)
    assert [w.turnaround(i) for i in (0, 1, 2)] == [10.0, 12.8, 40.0]
    # island 0 opens its next window at 22.8: island 1 is due at 25.6, within 0.35 x 10 s, and gets 10% of its own
    # turnaround on top; island 2 (due at 80) is not waited for
    assert w.deadline(22.8, [1, 2]) == pytest.approx(25.6 + 1.28)
    assert w.deadline(22.8, [2]) == 22.8  # nobody due soon: the window steps at once
    assert w.deadline(22.8, [7]) == pytest.approx(52.8)  # an island never answered: `first`
    assert PacedWait(first=5.0).deadline(1.0, [0]) == 6.0  # nothing known at all: `first`


def test_a_first_round_holds_start_up_and_is_not_taken_for_a_pace():
    w = PacedWait(reach=0.35, margin=0.1)
    for island in (0, 1):
        w.started(island, 0.0)
    w.arrived(0, 15.0)  # 5 s of start-up, then a 10 s round
    assert w.turnaround(0) is None and w.fastest() == 15.0
    assert w.deadline(15.0, [1]) == pytest.approx(15.0 + 0.35 * 15.0)  # island 1 not seen: up to the horizon
    w.arrived(1, 16.4)  # its first push, 1.4 s later: its link
    for island in (0, 1):
        w.answered(island, 16.4)
    w.arrived(0, 26.4)  # island 0's first real turnaround: 10 s
    assert w.turnaround(0) == 10.0 and w.turnaround(1) is None
    # island 1's pace, until it has a turnaround: its first round less island 0's start-up (15 - 10), 11.4 s
    assert w.expected(1) == pytest.approx(11.4)
    assert w.deadline(26.4, [1]) == pytest.approx(16.4 + 11.4 + 1.14)


def test_an_island_started_later_is_not_waited_for_before_a_round_of_its_own():
    w = PacedWait(reach=0.35, margin=0.1)
    for island in (0, 1):
        w.started(island, 0.0)
    for t in (15.0, 25.0):  # 5 s of start-up, then 10 s rounds
        for island in (0, 1):
            w.arrived(island, t)
            w.answered(island, t)
    w.started(2, 50.0)  # a restarted island, a new one on the servers, pulls at 50
    assert w.fastest() == 10.0
    assert w.deadline(52.0, [2]) == 52.0  # due at 60, past 52 + 3.5: the window steps at once
    assert w.deadline(57.0, [2]) == pytest.approx(57.0 + 3.5)  # due within the reach: waited for up to it


def test_a_pull_beside_islands_mid_round_is_held_until_their_next_window_can_have_stepped():
    w = PacedWait(reach=0.35, margin=0.1)
    for island in (0, 1):
        w.started(island, 0.0)
    for t in (15.0, 25.0):  # 5 s of start-up, then 10 s rounds; both answered at 25
        for island in (0, 1):
            w.arrived(island, t)
            w.answered(island, t)
    assert isinstance(w, JoinAlignment) and not isinstance(FixedWait(1.0), JoinAlignment)
    assert w.align_until(28.0, [0, 1]) == pytest.approx(35.0 + 3.5)  # due at 35, the window waits the reach past it
    assert w.align_until(36.0, [0, 1]) == pytest.approx(38.5)
    assert w.align_until(40.0, [0, 1]) == 40.0  # overdue (frozen?): nothing to wait for
    assert w.align_until(28.0, []) == 28.0  # alone
    w.started(2, 20.0)  # an island without a turnaround among the others: the job is starting, no hold
    assert w.align_until(28.0, [0, 1, 2]) == 28.0


def test_a_restarted_islands_pull_is_answered_with_the_others_next_window(tmp_path):
    rule = PacedWait(reach=2.0)  # a generous reach: the windows' timing on a loaded host is not what is under test
    with ThreadService(tmp_path, config(quorum=3, islands=3, wait=rule, per_push=True)) as service:
        a, b = service.link(0), service.link(1)
        for x in (a, b):
            x.send(Message(PULL, x.island))
        got: dict = {}
        for value in (1.0, 2.0):  # two rounds of 0.3 s: both islands have a turnaround
            time.sleep(0.3)
            first = threading.Thread(target=lambda v=value: got.update(a=push(a, v)))
            first.start()
            push(b, value)
            first.join(30)
        version = got["a"].ack.version
        answered: dict = {}
        c = service.link(2)  # a restarted island pulls mid-round: held, not waited for
        joiner = threading.Thread(target=lambda: answered.update(c=c.send(Message(PULL, 2))))
        joiner.start()
        time.sleep(0.15)
        assert "c" not in answered  # held until a and b step
        pushed = threading.Thread(target=lambda: got.update(a=push(a, 4.0)))
        pushed.start()
        both = push(b, 4.0)
        pushed.join(30)
        joiner.join(30)
        assert both.ack.version == version + 1  # the window stepped with a and b: nobody waited for c
        assert answered["c"].ack.version == version + 1 and torch.equal(answered["c"].flat, both.flat)


@pytest.mark.parametrize("value, want", [(None, None), (0, None), (0.0, None), (1.5, FixedWait), ("auto", PacedWait)])
def test_wait_values(value, want):
    rule = window_wait(value)
    assert rule is None if want is None else isinstance(rule, want)


@pytest.mark.parametrize("value, needle", [("soon", "seconds >= 0 or auto"), (-1, "wait must be >= 0")])
def test_bad_wait_values_are_refused(value, needle):
    with pytest.raises(ValueError, match=needle):
        window_wait(value)


def test_the_spec_takes_wait_auto_and_refuses_other_words():
    from islands.sync.outer import make_outer

    ps = make_outer("ps:inner_steps=4,quorum=2,wait=auto")
    assert isinstance(ps.wait, PacedWait)
    with pytest.raises(ValueError, match="wait"):
        make_outer("ps:inner_steps=4,quorum=2,wait=soon")


def test_the_spec_tunes_auto_with_reach_and_margin_and_refuses_them_without_it():
    from islands.sync.outer import make_outer
    from islands.sync.outer.ps_wait import MARGIN, REACH

    tuned = make_outer("ps:inner_steps=4,quorum=3,wait=auto,reach=0.5,margin=0.2").wait
    assert isinstance(tuned, PacedWait) and (tuned.reach, tuned.margin) == (0.5, 0.2)
    plain = make_outer("ps:inner_steps=4,quorum=3,wait=auto").wait
    assert isinstance(plain, PacedWait) and (plain.reach, plain.margin) == (REACH, MARGIN)
    for spec in ("ps:inner_steps=4,quorum=3,wait=1.5,reach=0.5", "ps:inner_steps=4,quorum=3,margin=0.2"):
        with pytest.raises(ValueError, match="wait=auto"):
            make_outer(spec)
    with pytest.raises(ValueError, match="reach > 0"):
        make_outer("ps:inner_steps=4,quorum=3,wait=auto,reach=0")


def test_equal_islands_with_auto_wait_for_each_other_every_window():
    run = Islands(VirtualClock([1.0, 1.0]), [1.0, 3.0], rounds=4, wait="auto").run()
    for answers in run.answers:
        assert [(a.version, a.staleness, a.stepped) for a, _, _ in answers] == [(v, 0, True) for v in (1, 2, 3, 4)]
        assert [x for _, _, x in answers] == [-4.0, -8.0, -12.0, -16.0]


def test_an_island_late_by_its_link_is_waited_for_where_a_short_fixed_wait_loses_it():
    # island 1's rounds take 1.3 virtual s to island 0's 1.0 (its link's transfers): auto learns that and holds
    # island 0's window for it, every window of both; a fixed 0.1 s steps island 0's windows alone instead
    auto = Islands(VirtualClock([1.0, 1.3]), [1.0, 3.0], rounds=4, wait="auto").run()
    fixed = Islands(VirtualClock([1.0, 1.3]), [1.0, 3.0], rounds=4, wait=0.1).run()
    together = lambda run: [x for _, _, x in run.answers[0]]  # noqa: E731
    assert together(auto)[1:] == [-8.0, -12.0, -16.0]  # from the second window on, both pushes in each
    assert auto.loop.state.counts["refused"] == 0
    assert together(fixed) != together(auto)
    assert max(a.staleness for a, _, _ in fixed.answers[1]) >= 1  # island 1's pushes land one window late


def test_an_island_four_times_slower_is_not_waited_for():
    run = Islands(VirtualClock([1.0, 4.0]), [1.0, 3.0], rounds=8, wait="auto").run()
    # once paces are known, island 0 waits only in the windows island 1 is about to join: far less than a fixed
    # 0.25 s per window, and never a whole round
    waited = run.loop.arrivals.waited[0]
    assert waited < 8 * 0.25
    assert run.loop.state.counts["refused"] == 0


def test_shard_servers_with_auto_learn_the_islands_turnarounds(tmp_path):
    # a reach of 2 turnarounds: island 1's 0.05 s lag stays inside it on a loaded host (the default 0.35 x 0.5 s left
    # 0.125 s of slack, and the test flaked under -n 2); the rule learning from the servers is what is under test
    rule = PacedWait(reach=2.0)
    with ThreadService(tmp_path, config(quorum=2, islands=2, wait=rule, servers=2, per_push=True)) as service:
        a, b = service.link(0), service.link(1)
        for x in (a, b):
            x.send(Message(PULL, x.island))
        time.sleep(0.5)  # a round of compute
        got: dict = {}
        waiting = threading.Thread(target=lambda: got.update(a=push(a, 1.0)))
        waiting.start()
        time.sleep(0.05)  # island 1 a little later: within 0.35 of island 0's 0.5 s turnaround
        both = push(b, 3.0)
        waiting.join(30)
        assert got["a"].ack.version == both.ack.version == 1
        assert torch.equal(got["a"].flat, torch.full((10,), -4.0))
        for server in service.servers:  # each server timed both islands' first rounds, from their pulls to their pushes
            assert server.wait.firsts[0] == pytest.approx(0.5, abs=0.4)
            assert server.wait.firsts[1] == pytest.approx(0.55, abs=0.4)
