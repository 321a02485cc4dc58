"""Krum and multi-Krum (LIT-344): pick the input(s) closest to their own nearest neighbours.

Score of input i = sum of squared distances to its n - f - 2 nearest other inputs; Krum returns the
lowest-scoring input, multi-Krum the average of the m lowest. Blanchard et al. prove robustness for
n > 2f + 2; we run whenever at least one neighbour is scored (n >= f + 3) and leave the bound to
the caller. Inputs dropped for NaN/Inf count against f (base.py), so f here is `effective_f()`.
Distances are computed in float64 so inputs near the float32 maximum do not overflow into ties.
"""

from __future__ import annotations

import torch

from islands.aggregate.base import BaseAggregator
from islands.aggregate.coordinate import mean_rows


def pairwise_sq_distances(rows: torch.Tensor) -> torch.Tensor:
    """[n, n] float64 squared Euclidean distances, exactly symmetric, zero diagonal.

    Computed by explicit differences (not the |a|^2 + |b|^2 - 2ab expansion, which cancels badly),
    one row at a time so memory stays at one [n, d] float64 temporary.
    """
    x = rows.to(torch.float64)
    n = x.shape[0]
    d2 = torch.zeros(n, n, dtype=torch.float64, device=x.device)
    for i in range(n - 1):
        row = (x[i + 1 :] - x[i]).pow(2).sum(dim=1)
        d2[i, i + 1 :] = row
        d2[i + 1 :, i] = row
    return d2


def krum_scores(rows: torch.Tensor, f: int) -> torch.Tensor:
    n = rows.shape[0]
    d2 = pairwise_sq_distances(rows)
    d2.fill_diagonal_(float("inf"))  # an input is not its own neighbour
    nearest = torch.sort(d2, dim=1).values[:, : n - f - 2]
    return nearest.sum(dim=1)


def _check_f(f: object) -> int:
    if not isinstance(f, int) or isinstance(f, bool) or f < 0:
        raise ValueError(f"f (the number of Byzantine inputs tolerated) must be an integer >= 0, got {f!r}")
    return f


class Krum(BaseAggregator):
    """`last_selected` holds the chosen row index (map to inputs with `last_report.kept`)."""

    name = "krum"

    def __init__(self, f: int):
        super().__init__()
        self.f = _check_f(f)
        self.last_selected: list[int] = []

    def min_inputs(self) -> int:
        return self.effective_f() + 3

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        # argmin returns the first minimum, so ties resolve the same way on every rank.
        best = int(torch.argmin(krum_scores(rows, self.effective_f())))
        self.last_selected = [best]
        return rows[best].clone()

    def __repr__(self) -> str:
        return f"krum:f={self.f}"


class MultiKrum(BaseAggregator):
    name = "multi-krum"

    def __init__(self, f: int, m: int):
        super().__init__()
        self.f = _check_f(f)
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"multi-krum m (how many inputs to average) must be an integer >= 1, got {m!r}")
        self.m = m
        self.last_selected: list[int] = []

    def min_inputs(self) -> int:
        return max(self.effective_f() + 3, self.m)

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(krum_scores(rows, self.effective_f()), stable=True)[: self.m]
        chosen = torch.sort(order).values  # average in row order: same sum order on every rank
        self.last_selected = [int(i) for i in chosen]
        return mean_rows(rows[chosen])

    def __repr__(self) -> str:
        return f"multi-krum:f={self.f},m={self.m}"
