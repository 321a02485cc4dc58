"""best_seconds: the least of N timed calls, after one warm-up."""

import time

import pytest

from islands.measure.timing import best_seconds


def test_best_seconds_is_the_fastest_call_and_warms_up_first():
    durations = iter([0.3, 0.3, 0.01, 0.3])  # the first is the warm-up and is not timed
    calls = []

    def fn():
        calls.append(1)
        time.sleep(next(durations))

    best = best_seconds(fn, 3)
    assert len(calls) == 4 and 0.01 <= best < 0.15  # the minimum, not the mean (0.2)
    assert best_seconds(lambda: None, 1, warm=False) < 0.01


def test_best_seconds_rejects_no_repeats():
    with pytest.raises(ValueError, match="repeats"):
        best_seconds(lambda: None, 0)
