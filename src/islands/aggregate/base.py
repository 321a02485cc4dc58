"""The Aggregator contract and the one place where non-finite inputs are turned away.

Policy (stated once, applied by every aggregator here): an input holding any NaN or Inf is dropped
whole before an aggregator or its state sees it. The drop is counted (`last_report`, `dropped_total`);
if fewer inputs remain than the aggregator needs, `TooFewInputsError` says how many were needed.
Aggregators see a finite matrix `rows` of shape [n, d] (one flattened input per row) in `combine`.

A dropped input counts against f: f bounds how many inputs may be faulty, and one that sends NaN/Inf
has shown itself faulty, so at most f - dropped faulty inputs hide among the rest. Aggregators that
take f (Krum, multi-Krum, NNM) use `effective_f()` = max(0, f - dropped) for the round; without it,
n = 4, f = 1 Krum could not survive the very NaN it is meant to tolerate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Aggregator(Protocol):
    """Combine same-shaped tensors into one. Deterministic given the same inputs and state, which checkpoints
    carry (state_dict / load_state_dict; BaseAggregator's are empty, for the stateless ones)."""

    def aggregate(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class TooFewInputsError(ValueError):
    """Raised when, after dropping non-finite inputs, fewer remain than an aggregator needs."""


@dataclass(frozen=True)
class AggregationReport:
    inputs: int  # how many tensors were handed in
    dropped: tuple[int, ...]  # indices of the inputs dropped for holding NaN or Inf

    @property
    def used(self) -> int:
        return self.inputs - len(self.dropped)

    @property
    def kept(self) -> tuple[int, ...]:
        """Input indices of the rows `combine` saw, in order (maps row indices back to inputs)."""
        gone = set(self.dropped)
        return tuple(i for i in range(self.inputs) if i not in gone)


def stack_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Validate a list of same-shaped floating tensors and stack them flattened, one per row."""
    if isinstance(tensors, torch.Tensor):
        raise TypeError("aggregate() takes a list of tensors, one per worker, not a single tensor")
    tensors = list(tensors)
    if not tensors:
        raise ValueError("aggregate() needs at least one tensor, got an empty list")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"input {i} is a {type(t).__name__}, expected a torch.Tensor")
        if not t.is_floating_point():
            raise TypeError(f"input {i} has dtype {t.dtype}; aggregators need a floating dtype")
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"input {i} is {tuple(t.shape)} {t.dtype} on {t.device}, but input 0 is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}; all inputs must match"
            )
    return torch.stack([t.reshape(-1) for t in tensors])


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision inputs are combined in float32 so sums of many workers do not round away."""
    return torch.promote_types(dtype, torch.float32)


class BaseAggregator:
    """Shared front door: validate, drop non-finite rows, check the count, then `combine`."""

    name = "base"

    def __init__(self) -> None:
        self.last_report: AggregationReport | None = None
        self.dropped_total = 0
        self.exposed = 0  # faulty inputs already dropped this round (see the module doc)

    def min_inputs(self) -> int:
        """The fewest finite inputs `combine` can work with."""
        return 1

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: finite [n, d] matrix, n >= min_inputs(). Returns a [d] vector of the same dtype."""
        raise TypeError(f"{type(self).__name__} must define combine(rows)")

    def aggregate(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        rows = stack_rows(tensors)
        shape = tensors[0].shape
        finite = torch.isfinite(rows).all(dim=1)
        dropped = tuple(int(i) for i in torch.nonzero(~finite).flatten())
        self.last_report = AggregationReport(inputs=rows.shape[0], dropped=dropped)
        self.dropped_total += len(dropped)
        if dropped:
            rows = rows[finite]
        self.set_exposed(len(dropped))
        self.check_count(rows.shape[0], dropped=len(dropped))
        out = self.combine(rows)
        if not torch.isfinite(out).all():
            # Finite inputs can still overflow inside a combine; never hand Inf to a model.
            raise FloatingPointError(f"{self!r} produced a non-finite result from finite inputs")
        return out.reshape(shape)

    def set_exposed(self, count: int) -> None:
        """Record this round's dropped inputs here and in any wrapped aggregator."""
        self.exposed = count
        inner = getattr(self, "inner", None)
        if isinstance(inner, BaseAggregator):
            inner.set_exposed(count)

    def effective_f(self) -> int:
        return max(0, getattr(self, "f", 0) - self.exposed)

    def check_count(self, n: int, dropped: int = 0) -> None:
        need = self.min_inputs()
        if n < need:
            why = f" after dropping {dropped} non-finite input(s)" if dropped else ""
            raise TooFewInputsError(f"{self!r} needs at least {need} finite inputs, {n} remain{why}")

    # Stateless by default; stateful aggregators override both.
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def __repr__(self) -> str:
        return self.name
