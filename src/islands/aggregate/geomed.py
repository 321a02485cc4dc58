"""Geometric median by the Weiszfeld iteration, smoothed and capped.

The geometric median minimises the sum of Euclidean distances to the inputs; its breakdown point is
one half. Weiszfeld's fixed point re-weights each input by 1 / distance. Two guards:
  * smoothing: weights are 1 / max(distance, eps), so an iterate landing on an input does not divide
    by zero (the smoothed Weiszfeld step of Pillutla et al.'s RFA);
  * a cap of `max_iter` iterations, stopping early once the objective's relative decrease is below
    `tol`. `last_iterations` and `last_converged` say what happened.
The iteration starts at the coordinate-wise median, which is already robust, and runs in float64.
"""

from __future__ import annotations

import torch

from islands.aggregate.base import BaseAggregator
from islands.aggregate.coordinate import CoordinateMedian


class GeometricMedian(BaseAggregator):
    name = "geomed"

    def __init__(self, max_iter: int = 100, tol: float = 1e-6, eps: float = 1e-8):
        super().__init__()
        if not isinstance(max_iter, int) or isinstance(max_iter, bool) or max_iter < 1:
            raise ValueError(f"geomed max_iter must be an integer >= 1, got {max_iter!r}")
        if not (isinstance(tol, (int, float)) and tol >= 0):
            raise ValueError(f"geomed tol must be a number >= 0, got {tol!r}")
        if not (isinstance(eps, (int, float)) and eps > 0):
            raise ValueError(f"geomed eps (smoothing distance) must be a number > 0, got {eps!r}")
        self.max_iter, self.tol, self.eps = max_iter, float(tol), float(eps)
        self.last_iterations = 0
        self.last_converged = False

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        x = rows.to(torch.float64)
        z = CoordinateMedian().combine(x)
        objective = torch.linalg.vector_norm(x - z, dim=1).sum()
        self.last_converged = False
        for it in range(1, self.max_iter + 1):
            dist = torch.linalg.vector_norm(x - z, dim=1)
            w = 1.0 / dist.clamp_min(self.eps)
            w = w / w.sum()
            # An explicit sum in row order, not a BLAS matvec whose order can vary with threads:
            # every rank must reach the bit-identical result.
            z = w[0] * x[0]
            for i in range(1, x.shape[0]):
                z = z + w[i] * x[i]
            new_objective = torch.linalg.vector_norm(x - z, dim=1).sum()
            self.last_iterations = it
            if objective - new_objective <= self.tol * new_objective:
                self.last_converged = True
                break
            objective = new_objective
        return z.to(rows.dtype)

    def __repr__(self) -> str:
        return f"geomed:iters={self.max_iter},tol={self.tol:g},eps={self.eps:g}"
