"""The ckpt-crash harness: its report counts what a kill -9 during saves left behind."""

from __future__ import annotations

import random

import pytest

from islands_bench.checkpoint_crash import run_crash_trials


@pytest.mark.slow  # spawns 2 interpreters that import torch
@pytest.mark.integration
def test_each_kill_is_judged_and_leaves_a_loadable_checkpoint(tmp_path):
    report = run_crash_trials(tmp_path / "store", 2, random.Random(1), elems=50_000, max_delay_s=0.4)
    assert report.trials == 2
    assert report.loadable + report.no_checkpoint_yet == 2 and report.loadable >= 1
    assert report.silent_corruptions == 0 and report.problems == []
