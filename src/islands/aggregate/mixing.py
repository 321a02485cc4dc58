"""Pre-aggregation steps, as wrappers around any aggregator.

NearestNeighborMixing (Allouah et al., 2023, "Fixing by Mixing"): replace each input by the average
of its n - f nearest inputs (itself included) before the inner aggregator sees them; this shrinks the
spread of honest inputs while Byzantine ones are pulled toward the honest cluster.

Bucketing (Karimireddy, He and Jaggi, 2022): shuffle the inputs, average them in buckets of s, and
aggregate the bucket means; this lowers heterogeneity between honest inputs. The shuffle draws from an
explicit torch.Generator seeded at construction and saved in state_dict, so every rank that builds
the same Bucketing and feeds it the same rounds draws the same buckets.
"""

from __future__ import annotations

import torch

from islands.aggregate.base import BaseAggregator
from islands.aggregate.coordinate import mean_rows
from islands.aggregate.krum import _check_f, pairwise_sq_distances


def _check_inner(inner: object) -> BaseAggregator:
    if not isinstance(inner, BaseAggregator):
        raise TypeError(f"a pre-aggregation step wraps an islands aggregator, got {type(inner).__name__}")
    return inner


class NearestNeighborMixing(BaseAggregator):
    name = "nnm"

    def __init__(self, inner: BaseAggregator, f: int):
        super().__init__()
        self.inner = _check_inner(inner)
        self.f = _check_f(f)

    def min_inputs(self) -> int:
        return max(self.effective_f() + 1, self.inner.min_inputs())

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        d2 = pairwise_sq_distances(rows)
        # Stable sort: equal distances keep row order, so ties break alike everywhere. Row i's own
        # zero distance sorts first unless another row is identical, which mixes to the same value.
        nearest = torch.argsort(d2, dim=1, stable=True)[:, : n - self.effective_f()]
        mixed = torch.stack([mean_rows(rows[torch.sort(nearest[i]).values]) for i in range(n)])
        return self.inner.combine(mixed)

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state.get("inner", {}))

    def __repr__(self) -> str:
        return f"nnm:f={self.f}+{self.inner!r}"


class Bucketing(BaseAggregator):
    name = "bucketing"

    def __init__(self, inner: BaseAggregator, s: int, seed: int = 0):
        super().__init__()
        self.inner = _check_inner(inner)
        if not isinstance(s, int) or isinstance(s, bool) or s < 1:
            raise ValueError(f"bucketing s (bucket size) must be an integer >= 1, got {s!r}")
        self.s, self.seed = s, int(seed)
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(self.seed)
        self.last_buckets: list[list[int]] = []

    def min_inputs(self) -> int:
        # ceil(n / s) bucket means must satisfy the inner aggregator.
        return (self.inner.min_inputs() - 1) * self.s + 1

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        perm = torch.randperm(n, generator=self.generator).to(rows.device)
        buckets = [torch.sort(perm[j : j + self.s]).values for j in range(0, n, self.s)]
        means = torch.stack([mean_rows(rows[b]) for b in buckets])
        self.last_buckets = [[int(i) for i in b] for b in buckets]
        return self.inner.combine(means)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "generator" in state:
            self.generator.set_state(state["generator"])
        self.inner.load_state_dict(state.get("inner", {}))

    def __repr__(self) -> str:
        seed = f",seed={self.seed}" if self.seed else ""
        return f"bucketing:s={self.s}{seed}+{self.inner!r}"
