"""Interval policies: CheckFreq bound, Young/Daly, their combination, and the failure simulator."""

import math
import random

import pytest

from islands.checkpoint.policy import (
    CheckFreqPolicy,
    CombinedIntervalPolicy,
    YoungDalyInterval,
    checkfreq_interval,
    expected_waste_fraction,
    simulate_failures,
    young_daly_seconds,
)
from islands.checkpoint.policy.interval import DAY_S


def test_checkfreq_keeps_overhead_under_the_bound():
    d = checkfreq_interval(iter_s=0.2, stall_s=0.05, persist_s=0.1, bound=0.035)
    assert d.binding == "overhead" and d.steps == math.ceil(0.05 / (0.035 * 0.2))
    assert 0.05 / (d.steps * 0.2) <= 0.035 < 0.05 / ((d.steps - 1) * 0.2)
    slow_disk = checkfreq_interval(iter_s=0.2, stall_s=0.01, persist_s=5.0)
    assert slow_disk.binding == "persist" and slow_disk.steps == 25 and "persist" in slow_disk.reason
    with pytest.raises(ValueError, match="iter_s"):
        checkfreq_interval(0, 1, 1)


def test_checkfreq_policy_adapts_up_and_down():
    p = CheckFreqPolicy(smoothing=1.0)
    assert p.decide().binding == "min"  # nothing profiled yet
    p.observe_iteration(0.1)
    p.observe_checkpoint(0.5, 0.1)
    long = p.decide().steps
    p.observe_checkpoint(0.05, 0.1)  # snapshots got cheaper: interval shortens again
    short = p.decide().steps
    p.observe_iteration(0.01)  # faster steps: more steps per checkpoint
    assert short < long and p.decide().steps == math.ceil(0.05 / (0.035 * 0.01))  # grows with faster steps


def test_young_daly_formula_and_default_mttf():
    yd = YoungDalyInterval(1024, checkpoint_cost_s=10.0, iter_s=1.0)
    assert yd.mttf_s / DAY_S == pytest.approx(3748.25 / 1024)  # LIT-222: 3.66 d at 1,024 GPUs
    assert yd.decide().seconds == pytest.approx(math.sqrt(2 * 10 * 3748.25 * DAY_S / 1024), abs=1.0)
    # the formula is the minimum of first-order waste
    t = young_daly_seconds(10.0, yd.mttf_s)
    assert expected_waste_fraction(t, 10, yd.mttf_s) < expected_waste_fraction(0.8 * t, 10, yd.mttf_s)
    assert expected_waste_fraction(t, 10, yd.mttf_s) < expected_waste_fraction(1.25 * t, 10, yd.mttf_s)
    # bigger job, shorter interval
    assert YoungDalyInterval(16384, checkpoint_cost_s=10.0, iter_s=1.0).decide().steps < yd.decide().steps


def test_observed_failures_update_the_estimate():
    yd = YoungDalyInterval(100, per_device_mtbf_s=1000 * DAY_S, checkpoint_cost_s=1.0, iter_s=1.0)
    before = yd.decide().steps
    yd.observe_uptime(1 * DAY_S)  # 100 device-days of exposure
    yd.observe_failure(5)  # far more than 1000-day MTBF predicts
    assert yd.per_device_mtbf_s == pytest.approx((1000 + 100) * DAY_S / 6)
    assert yd.decide().steps < before


def test_combined_policy_takes_the_binding_constraint_and_says_why():
    c = CombinedIntervalPolicy(CheckFreqPolicy(), YoungDalyInterval(16384))
    c.observe_iteration(1.0)
    c.observe_checkpoint(10.0, 5.0)
    d = c.decide()
    assert d.binding == "failures" and d.steps == c.failures.decide().steps > c.checkfreq.decide().steps
    assert "Young/Daly" in d.reason and "overhead" in d.reason
    c2 = CombinedIntervalPolicy(CheckFreqPolicy(overhead_bound=0.001), YoungDalyInterval(8))
    c2.observe_iteration(1.0)
    c2.observe_checkpoint(10.0, 5.0)
    c2.failures.per_device_mtbf_s  # noqa: B018
    c2.failures.prior_mtbf_s = 0.1 * DAY_S  # very failure-prone: Young/Daly wants short intervals
    assert c2.decide().binding == "overhead"


def test_simulator_policy_beats_badly_chosen_fixed_intervals():
    def mean_waste(policy):
        runs = [simulate_failures(policy, 16384, 24, random.Random(i), stall_s=10, persist_s=20) for i in range(12)]
        return sum(r.waste_fraction for r in runs) / len(runs)

    policy = CombinedIntervalPolicy(CheckFreqPolicy(), YoungDalyInterval(16384))
    policy.observe_iteration(1.0)
    policy.observe_checkpoint(10.0, 20.0)
    ours = mean_waste(policy)
    assert ours < mean_waste(30) and ours < mean_waste(6000)
    r = simulate_failures(100, 8, 1, random.Random(0), stall_s=1.0)
    assert r.failures == 0 and r.checkpoints == 36 and r.overhead_s == 36.0 and r.wall_s == 3636.0
