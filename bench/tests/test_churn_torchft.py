"""The churn experiment's common stall metric and the torchft round-log parsing (no torchft needed)."""

import json

import pytest

from islands_bench.experiments.churn_torchft import (
    event_stalls,
    islands_commits,
    join_wait_rounds,
    read_round_log,
    stalls_over_survivors,
    torchft_commits,
)


def _rounds(start, count, every, size):
    return [(start + i * every, size) for i in range(count)]


def test_kill_stall_is_longest_gap_until_the_smaller_group_commits_minus_normal_round():
    # 10 rounds of 0.1 s with 4 members, a kill at 0.95, the next commit (3 members) 5.2 s later
    commits = _rounds(0.0, 10, 0.1, 4) + _rounds(6.1, 5, 0.1, 3)
    (row,) = event_stalls(commits, [(0.95, "kill")])
    assert row["reflected"] and row["size_before"] == 4 and row["size_after"] == 3
    assert row["normal_round_s"] == pytest.approx(0.1)
    assert row["longest_gap_s"] == pytest.approx(5.2)
    assert row["stall_s"] == pytest.approx(5.1)
    assert row["rounds_until_reflected"] == 1


def test_stall_counts_failed_rounds_in_between_and_ignores_gaps_after_the_change():
    # after the kill: one slow commit still by the old group (a round in flight), then 0.6 s, then the new group;
    # a later 3 s gap (after the group already shrank) belongs to no event
    commits = _rounds(0.0, 5, 0.2, 4) + [(1.3, 4), (1.9, 3), (4.9, 3), (5.1, 3)]
    (row,) = event_stalls(commits, [(1.0, "kill")])
    assert row["longest_gap_s"] == pytest.approx(0.6)
    assert row["stall_s"] == pytest.approx(0.4)
    assert row["rounds_until_reflected"] == 2


def test_join_stall_and_two_events():
    commits = _rounds(0.0, 5, 0.1, 3) + _rounds(2.4, 11, 0.1, 2) + [(3.5, 2), (3.9, 3), (4.0, 3)]
    kill, join = event_stalls(commits, [(0.45, "kill"), (3.45, "join")])
    assert kill["longest_gap_s"] == pytest.approx(2.0) and kill["stall_s"] == pytest.approx(1.9)
    assert join["size_before"] == 2 and join["size_after"] == 3
    assert join["longest_gap_s"] == pytest.approx(0.4) and join["stall_s"] == pytest.approx(0.3)


def test_join_released_before_this_survivor_committed_the_kill_starts_from_the_kill_change():
    # kill at 0.45; this survivor commits the smaller group only at 5.5, just after the join at 5.49;
    # the joiner is in from 5.8: the join's span is 5.5 -> 5.8, not measured against the pre-kill size
    commits = _rounds(0.0, 5, 0.1, 4) + [(5.5, 3), (5.8, 4), (5.9, 4)]
    kill, join = event_stalls(commits, [(0.45, "kill"), (5.49, "join")])
    assert kill["longest_gap_s"] == pytest.approx(5.1) and kill["size_after"] == 3
    assert join["reflected"] and join["size_before"] == 3 and join["size_after"] == 4
    assert join["longest_gap_s"] == pytest.approx(0.3)


def test_event_never_reflected_is_reported_not_invented():
    (row,) = event_stalls(_rounds(0.0, 10, 0.1, 4), [(0.5, "join")])
    assert row["reflected"] is False and "stall_s" not in row


def test_bad_input_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="at least 3"):
        event_stalls([(0.0, 2), (0.1, 2)], [(0.05, "kill")])
    with pytest.raises(ValueError, match="'kill' or 'join'"):
        event_stalls(_rounds(0.0, 5, 0.1, 2), [(0.2, "crash")])
    with pytest.raises(ValueError, match="time order"):
        event_stalls(_rounds(0.0, 5, 0.1, 2), [(0.3, "kill"), (0.2, "join")])
    with pytest.raises(ValueError, match="before the first event"):
        event_stalls(_rounds(1.0, 5, 0.1, 2), [(0.5, "kill")])


def test_over_survivors_takes_max_and_mean_of_those_that_saw_the_change():
    a = event_stalls(_rounds(0.0, 5, 0.1, 3) + _rounds(2.0, 3, 0.1, 2), [(0.45, "kill")])
    b = event_stalls(_rounds(0.0, 5, 0.1, 3) + _rounds(3.0, 3, 0.1, 2), [(0.45, "kill")])
    (row,) = stalls_over_survivors({"r0": a, "r1": b})
    assert row["survivors"] == 2
    assert row["max_stall_s"] == pytest.approx(2.5) and row["mean_stall_s"] == pytest.approx(2.0)


def test_join_wait_rounds():
    commits = _rounds(0.0, 5, 0.1, 2) + [(0.5, 2), (0.6, 2), (0.7, 3)]
    assert join_wait_rounds(commits, 0.45) == 2  # 0.5 and 0.6 without it, 0.7 with it
    assert join_wait_rounds(_rounds(0.0, 5, 0.1, 2), 0.25) is None


def test_round_log_parsing_drops_a_line_cut_by_sigkill(tmp_path):
    path = tmp_path / "r2.jsonl"
    rows = [
        {"t": 1.0, "step": 1, "committed": True, "participants": 3, "loss": 2.3},
        {"t": 1.1, "step": 1, "committed": False, "participants": 3, "loss": 2.2},
        {"t": 1.2, "step": 2, "committed": True, "participants": 2, "loss": 2.1},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"t": 1.3, "ste')
    parsed = read_round_log(path)
    assert parsed == rows
    assert torchft_commits(parsed + [{"final": True, "t": 2.0, "val_loss": 0.1}]) == [(1.0, 3), (1.2, 2)]
    assert read_round_log(tmp_path / "missing.jsonl") == []


def test_islands_commits_from_an_elastic_record():
    member = {
        "syncs": [
            {"kind": "outer_delta", "start": 2.0, "seconds": 0.5, "size": 3},
            {"kind": "elastic_state", "start": 1.0, "seconds": 0.1, "size": 3},
            {"kind": "outer_delta", "start": 1.0, "seconds": 0.2, "size": 4},
        ]
    }
    assert islands_commits(member) == [(1.2, 4), (2.5, 3)]
