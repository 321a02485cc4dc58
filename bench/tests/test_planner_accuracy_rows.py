"""planner-accuracy's arithmetic: the steady-state step time read off a run's series, and the summary against
issue 37's goals."""

from __future__ import annotations

import pytest

from islands_bench.experiments.planner_accuracy import _summary, full_tier_steps, headline, steady_step_seconds


def _series(step_s: dict[int, float], every: int = 10, steps: int = 100) -> list[dict]:
    """Log entries every `every` steps; `step_s`: seconds of each step (default 1.0)."""
    out, elapsed = [], 0.0
    for s in range(1, steps + 1):
        elapsed += step_s.get(s, 1.0)
        if s % every == 0:
            out.append({"step": s, "loss": 0.0, "elapsed": elapsed})
    return out


def test_steady_step_leaves_out_the_first_steps():
    series = _series({1: 50.0, 2: 10.0})  # gloo's first collectives, lazy allocations
    assert steady_step_seconds(series, 1, 10, 100) == pytest.approx(1.0)


def test_steady_step_counts_whole_rounds_only():
    # rounds of 50 steps: the round's step costs 26 s more; from step 50 to 100 exactly one round is counted
    series = _series({50: 27.0, 100: 27.0})
    assert steady_step_seconds(series, 50, 50, 100) == pytest.approx((49 + 27) / 50)
    # rounds of 10 from step 10: nine rounds in 90 steps
    tens = _series({s: 3.0 for s in range(10, 101, 10)})
    assert steady_step_seconds(tens, 10, 10, 100) == pytest.approx((9 * 9 + 9 * 3) / 90)


def test_steady_step_is_none_without_a_whole_round_in_the_run():
    assert steady_step_seconds(_series({}, steps=40), 50, 50, 40) is None


def _row(strategy: str, pred: float, meas: float, mem_err=None) -> dict:
    return {
        "model": "lm",
        "link": "loopback",
        "strategy": strategy,
        "pred_step_ms": pred,
        "meas_step_ms": meas,
        "step_err": abs(pred - meas) / meas,
        "bytes_err": 0.0,
        "mem_err": mem_err,
        "load_before": 0.5,
        "load_after": 1.5,
    }


def test_summary_says_whether_each_goal_was_met():
    rows = [_row("a", 10.0, 10.5, 0.01), _row("b", 12.0, 11.0), _row("c", 20.0, 10.0)]
    s = _summary(rows)
    assert s["step_err"]["median"] == pytest.approx(1 / 11) and s["step_err"]["worst"] == pytest.approx(1.0)
    assert not s["step_err"]["met"]  # worst 100% > 40%
    assert s["bytes_err"]["met"] and s["mem_err"]["met"] and s["mem_err"]["n"] == 1
    # the planner picked a (10.0 predicted); measured fastest is c (10.0) and a (10.5) is within 10% of it
    assert s["choices"][0]["planner_first"] == "a" and s["choices"][0]["measured_fastest"] == "c"
    assert s["first_choice"]["within_10pct_rate"] == 1.0 and s["first_choice"]["met"]
    assert s["load_average"] == {"min": 0.5, "max": 1.5}
    words = "\n".join(headline(s))
    assert "step time: median error 9.1%, worst 100.0%" in words and "NOT met" in words
    assert "load average (1 min) around the runs: 0.50 to 1.50" in words


def test_summary_meets_the_step_goal_within_its_bounds():
    s = _summary([_row("a", 10.0, 11.0), _row("b", 10.0, 9.0), _row("c", 10.0, 12.0)])
    assert s["step_err"]["met"]  # median 10%, worst 16.7%


def test_a_full_tier_run_holds_its_warm_up_and_three_steady_rounds():
    # per-step strategies and short rounds: the 60-step floor; H=50: a round of warm-up and three more
    assert [full_tier_steps(r) for r in (1, 10, 20, 50)] == [60, 60, 80, 200]
    for r in (1, 10, 20, 50):
        steps = full_tier_steps(r)
        series = [{"step": s, "elapsed": 0.1 * s} for s in range(1, steps + 1)]
        assert steady_step_seconds(series, r, max(10, r), steps) is not None
