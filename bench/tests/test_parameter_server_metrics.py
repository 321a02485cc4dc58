"""The parameter-server experiment's bookkeeping (no job needed): time to target, loss at equal wall time, the
server's goodput and memory read from a checkpoint manifest, the churn goodput estimate from live logs, bytes."""

import json

import pytest

from islands_bench.experiments.parameter_server import (
    blocked_at,
    churn_goodput,
    loss_at,
    mb_per_worker,
    normalised_seconds,
    server_columns,
    server_cpu_seconds,
    server_from_checkpoint,
    steps_to,
    time_to,
)

SERIES = [
    {"step": 0, "elapsed": 0.0, "val_loss": 2.3},
    {"step": 20, "elapsed": 1.5, "val_loss": 1.0},
    {"step": 40, "elapsed": 3.0, "val_loss": 0.4},
    {"step": 60, "elapsed": 4.5, "val_loss": 0.5},
]


def test_time_to_target_is_the_first_evaluation_at_or_under_it():
    assert time_to(SERIES, 1.0) == 1.5  # at, not only under
    assert time_to(SERIES, 0.45) == 3.0
    assert time_to(SERIES, 0.1) is None
    assert (steps_to(SERIES, 0.45), steps_to(SERIES, 0.1)) == (40, None)


def test_loss_at_equal_wall_time_is_the_last_evaluation_at_or_before_it():
    assert loss_at(SERIES, 3.0) == 0.4
    assert loss_at(SERIES, 4.4) == 0.4
    assert loss_at(SERIES, 10.0) == 0.5
    assert loss_at([{"elapsed": 2.0, "val_loss": 1.0}], 1.0) is None


def _manifest(tmp_path, counts, tensors):
    step = tmp_path / "ckpt" / "step-000400"
    step.mkdir(parents=True)
    body = {
        "skeleton": {"strategy": {"outer": {"ps_version": 3, "ps_server": {"version": 3, "counts": counts}}}},
        "tensors": tensors,
    }
    (step / "rank00000.manifest.json").write_text(json.dumps({"format": "islands-checkpoint/1", "body": body}))
    return tmp_path / "ckpt"


def test_server_goodput_and_memory_come_from_the_hosting_ranks_checkpoint(tmp_path):
    counts = {"pushes": 10, "refused": 2, "steps": 8, "samples": 600.0, "samples_refused": 200.0}
    tensors = {
        "strategy/outer/ps_server/params/0": {"dtype": "float32", "shape": [1000]},
        "strategy/outer/ps_server/rules/0/momentum_buffer": {"dtype": "float32", "shape": [1000]},
        "strategy/outer/global": {"dtype": "float32", "shape": [1000]},  # the island's copy: not the server's
        "model/w": {"dtype": "float32", "shape": [10, 100]},
    }
    got = server_from_checkpoint(_manifest(tmp_path, counts, tensors))
    assert got["goodput"] == pytest.approx(0.75)  # 600 of 800 pushed samples accepted
    assert (got["pushes"], got["refused"], got["outer_steps"]) == (10, 2, 8)
    assert got["server_mb"] == pytest.approx(8000 / 1e6)


def _server(cpu, memory, refused, goodput, kind="max_rss"):
    return {
        "cpu_seconds": cpu,
        "peak_memory_bytes": memory,
        "peak_memory": kind,
        "pushes_refused": refused,
        "goodput": goodput,
    }


def test_the_server_columns_are_the_run_records_measured_report():
    report = {
        "mode": "processes",
        "complete": True,
        "cpu_seconds": 3.5,
        "restarts": 1,
        "servers": [_server(2.0, 300e6, 1, 0.9), _server(1.5, 200e6, 1, 0.9)],
    }
    rec = {"parameter_server": report, "run_dir": "/nowhere", "summary": {"islands": 2}}  # no checkpoint read
    got = server_columns(rec, 1000)
    assert (got["server_cpu_s"], got["server_mb"], got["server_memory"]) == (3.5, 500.0, "max_rss")
    assert (got["refused"], got["goodput"], got["server_restarts"]) == (1, 0.9, 1)
    assert got["server_source"] == "measured (processes mode)"


def test_without_a_report_the_server_columns_are_the_labelled_estimate(tmp_path):
    counts = {"pushes": 4, "refused": 0, "steps": 4, "samples": 400.0, "samples_refused": 0.0}
    ckpt = _manifest(tmp_path, counts, {"strategy/outer/ps_server/params/0": {"dtype": "float32", "shape": [1000]}})
    rec = {"run_dir": str(ckpt.parent), "summary": {"islands": 2}}
    missing = {"mode": "processes", "servers": [], "cpu_seconds": None, "missing": "the supervisor was killed"}
    for record, why in ((rec, "has no parameter_server report"), ({**rec, "parameter_server": missing}, "killed")):
        got = server_columns(record, 1000)
        assert got["server_source"].startswith("estimate") and why in got["server_source"]
        assert got["server_mb"] == pytest.approx(4000 / 1e6) and got["server_cpu_s"] >= 0.0


def test_a_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="no checkpoint"):
        server_from_checkpoint(tmp_path / "nowhere")


def _live(tmp_path, logs: dict[str, range]):
    live = tmp_path / "live"
    live.mkdir()
    for name, steps in logs.items():
        lines = [json.dumps({"kind": "params"})] + [json.dumps({"step": s, "metrics": {}}) for s in steps]
        (live / f"{name}.jsonl").write_text("\n".join(lines))
    return tmp_path


def test_churn_goodput_counts_a_killed_incarnations_steps_since_its_last_round_boundary(tmp_path):
    # H = 10; w0 and w1 run 0..100; the victim w2 runs 0..34 (killed: 4 steps past round 30 lost), restarts at
    # 40 and runs to 70 (killed just after its boundary step 70 was logged: that round was pushed, nothing lost;
    # the churn's kills under ps come exactly there), restarts at 80 and ends at 100
    run = _live(tmp_path, {"w0": range(101), "w1": range(101), "w2": range(35), "w2.1": range(40, 71)})
    (run / "live" / "w2.2.jsonl").write_text("\n".join(json.dumps({"step": s}) for s in range(80, 101)))
    computed = 100 + 100 + 34 + 30 + 20
    assert churn_goodput(run, 10) == pytest.approx(1 - 4 / computed)


def test_churn_goodput_counts_a_restarts_first_step_and_loses_a_round_cut_before_its_boundary(tmp_path):
    # a restarted island logs its entry step's next step first (41: it trained 41..69 = 29 steps from 40) and is
    # killed with step 69 logged: the boundary 70 was never reached, so the 9 steps past 60 are lost
    run = _live(tmp_path, {"w0": range(101), "w1": range(101), "w2": range(41), "w2.1": range(41, 70)})
    (run / "live" / "w2.2.jsonl").write_text("\n".join(json.dumps({"step": s}) for s in range(71, 101)))
    computed = 100 + 100 + 40 + 29 + 30
    assert churn_goodput(run, 10) == pytest.approx(1 - 9 / computed)


def test_churn_goodput_is_one_without_kills(tmp_path):
    assert churn_goodput(_live(tmp_path, {"w0": range(51), "w1": range(51)}), 10) == 1.0


def test_bytes_are_sent_plus_received_per_worker():
    rec = {
        "comm": {"per_rank": [{"total_sent": 1e6, "total_received": 3e6}, {"total_sent": 3e6, "total_received": 1e6}]}
    }
    assert mb_per_worker(rec) == pytest.approx(4.0)


def test_server_cpu_grows_with_the_pushes_replayed():
    assert server_cpu_seconds(1000, 1, 2) >= 0.0 and server_cpu_seconds(200_000, 40, 3) > server_cpu_seconds(
        200_000, 1, 3
    )


def test_blocked_seconds_to_a_step_are_the_most_blocked_ranks_last_entry_at_or_before_it(tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    for rank, blocked in ((0, [0.1, 0.2, 0.3]), (1, [1.0, 2.0, 9.0])):  # rank 1 pushes over the link
        lines = [json.dumps({"kind": "params"})] + [
            json.dumps({"step": 20 * (i + 1), "metrics": {"time/blocked_s": b}}) for i, b in enumerate(blocked)
        ]
        (live / f"rank{rank}.jsonl").write_text("\n".join(lines))
    assert blocked_at(tmp_path, 40) == 2.0
    assert blocked_at(tmp_path, 59) == 2.0
    assert blocked_at(tmp_path, 10) == 0.0


def test_normalised_seconds_are_steps_at_one_compute_speed_plus_the_arms_own_blocking():
    assert normalised_seconds(80, 0.5, 3.0) == 43.0
    assert normalised_seconds(None, 0.5, 3.0) is None
