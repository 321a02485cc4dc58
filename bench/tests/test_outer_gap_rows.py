"""diloco-gap's row arithmetic: loss gap, and byte ratios for the compared phase and with the warm-up."""

from __future__ import annotations

import pytest

from islands_bench.experiments.outer_diloco import OUTER_LRS, OUTER_MOMENTA, gap_row, outer_spec


def record(loss: float, sent: dict, calls: dict, steps: int = 1000) -> dict:
    total = sum(sent.values())
    return {
        "summary": {"final_val_loss": loss, "mb_sent_per_worker": total / 1e6, "seconds_per_step": 0.1},
        "comm": {"per_rank": [{"sent": sent, "calls": calls}]},
        "config": {"train": {"steps": steps}},
        "interconnect_line": "gloo loopback",
    }


def test_warm_start_row_counts_the_compared_phase_and_the_whole_run():
    p4 = 4_000  # 4 bytes x 1,000 parameters per exchange
    ddp = record(1.0, {"grad_all_reduce": 1000 * p4}, {"grad_all_reduce": 1000})
    ref = gap_row("ddp", ddp, {"bytes_per_worker": 1000 * p4, "final_val_loss": 1.0}, {})
    warm = record(
        1.05, {"outer_warm_grad": 250 * p4, "outer_delta": 8 * p4}, {"outer_warm_grad": 250, "outer_delta": 8}
    )
    row = gap_row("warm", warm, ref, {"warm_start": 250})
    assert row["loss_gap_pct"] == pytest.approx(5.0)
    assert row["warm_bytes_per_worker"] == 250 * p4
    assert row["bytes_ratio_compared_phase"] == pytest.approx(750 / 8)  # DDP's 750 steps vs 8 rounds
    assert row["bytes_ratio_ddp_over_run"] == pytest.approx(1000 / 258)
    assert row["syncs"] == 8  # rounds, not warm-up all-reduces


def test_rows_without_warm_start_have_no_phase_ratio():
    ref = {"bytes_per_worker": 100, "final_val_loss": 2.0}
    row = gap_row("alone", record(2.5, {}, {}), ref, {})
    assert row["loss_gap_pct"] == pytest.approx(25.0)
    assert "bytes_ratio_compared_phase" not in row


def test_outer_grid_specs():
    assert outer_spec(1.4, 0.0) == "outer=sgd,outer_lr=1.4,momentum=0"
    assert outer_spec(0.7, 0.9) == "outer=nesterov,outer_lr=0.7,momentum=0.9"
    from islands.sync.outer import parse_outer

    for lr in OUTER_LRS:
        for m in OUTER_MOMENTA:
            spec = parse_outer(f"diloco:inner_steps=100,{outer_spec(lr, m)}")
            assert spec["outer_lr"] == lr and spec["momentum"] == m


def test_ddp_steps_to_reach_interpolates_the_curve():
    from islands_bench.experiments.outer_diloco import ddp_steps_to_reach

    rec = {
        "series": {
            "val": [{"step": 0, "val_loss": 5.0}, {"step": 100, "val_loss": 3.0}, {"step": 200, "val_loss": 2.0}]
        }
    }
    assert ddp_steps_to_reach(rec, 2.5) == pytest.approx(150.0)
    assert ddp_steps_to_reach(rec, 3.0) == pytest.approx(100.0)
    assert ddp_steps_to_reach(rec, 1.9) is None  # better than DDP ever got


def test_a_run_that_sends_nothing_has_no_byte_ratio():
    row = gap_row("alone", record(2.0, {}, {}), {"bytes_per_worker": 100, "final_val_loss": 2.0}, {})
    assert row["bytes_ratio_ddp_over_run"] is None and row["bytes_per_worker"] == 0
