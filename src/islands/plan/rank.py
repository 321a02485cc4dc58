"""Ranking predictions and finding the crossovers: the cross-island rates at which the fastest strategy changes."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from islands.plan.costs import Prediction


def ranked(predictions: list[Prediction]) -> list[Prediction]:
    """Fastest first among those that fit the memory budget; those that do not fit after, fastest first."""
    return sorted(predictions, key=lambda p: (not p.fits, p.step_s))


@dataclass(frozen=True)
class Crossover:
    rate_bps: float  # the fastest changes between the sweep's rate below this one and this one
    slower: str  # fastest below the crossover
    faster: str  # fastest from here up


def rate_sweep(low_bps: float = 1e6, high_bps: float = 1e11, per_decade: int = 8) -> list[float]:
    n = round(math.log10(high_bps / low_bps) * per_decade)
    return [low_bps * 10 ** (i / per_decade) for i in range(n + 1)]


def crossovers(step_times: Callable[[float], dict[str, float]], rates: list[float]) -> list[Crossover]:
    """`step_times(rate)` -> {label: predicted step seconds} at that cross-island rate; every change of the fastest."""
    out, before = [], None
    for r in rates:
        times = step_times(r)
        best = min(times, key=lambda k: times[k])
        if before is not None and best != before:
            out.append(Crossover(r, before, best))
        before = best
    return out
