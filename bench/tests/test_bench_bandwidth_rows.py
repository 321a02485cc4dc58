"""compression-vs-bandwidth's row arithmetic on made-up run records (the bench itself needs root and ~25 min)."""

from islands_bench.experiments.compress_bandwidth import BEST_POWERSGD, TARGET_SLACK, _rows_for


def _rec(final: float, s_per_step: float, nbytes: float, curve: list[tuple[float, float]]) -> dict:
    return {
        "summary": {
            "final_val_loss": final,
            "bytes_sent_per_worker_per_step": nbytes,
            "seconds_per_step": s_per_step,
            "compute_seconds": 0.1 * 300,
            "steps": 300,
            "comm_fraction": 0.5,
        },
        "series": {"val": [{"step": i, "val_loss": v, "elapsed": t, "mb_sent": 0} for i, (t, v) in enumerate(curve)]},
        "interconnect_line": "testbed 100mbit",
    }


def test_time_to_target_and_speedup_per_regime():
    ddp = _rec(2.0, 0.6, 3.5e6, [(60, 3.0), (120, 2.1), (180, 2.0)])  # reaches 2.06 at 180 s
    fast = _rec(2.05, 0.1, 1.6e5, [(10, 3.0), (20, 2.2), (30, 2.05)])  # reaches it at 30 s: 6x
    never = _rec(2.5, 0.1, 1e5, [(10, 3.0), (30, 2.5)])
    rows, lines = _rows_for(
        "100mbit",
        "comm-bound: global batch 8",
        {"goodput_mbit": 96.0},
        {"none": ddp, BEST_POWERSGD: fast, "sign": never},
    )
    by = {r["compress"]: r for r in rows}
    assert by["none"]["time_to_target_s"] == 180 and by["none"]["target_speedup_vs_ddp"] == 1.0
    assert by[BEST_POWERSGD]["time_to_target_s"] == 30 and by[BEST_POWERSGD]["target_speedup_vs_ddp"] == 6.0
    assert by["sign"]["time_to_target_s"] is None and by["sign"]["target_speedup_vs_ddp"] is None
    assert all(r["regime"] == "comm-bound: global batch 8" and r["achieved_goodput_mbit"] == 96.0 for r in rows)
    assert f"x{TARGET_SLACK:g} (2.060)" in lines[0] and "(6.0x)" in lines[0] and len(lines) == 1  # no rank-4 pair here
