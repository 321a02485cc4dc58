"""Where to cut a model into pipeline stages: three policies over the ordered pieces.

    equal      balance parameter bytes per stage (the parameter-count baseline of Q-3)
    graph      from the traced forward: among splits within GRAPH_SLACK of the best parameter balance,
               the one whose cut tensors are smallest (Q-3; the same rule as FSDP's graph:K units)
    balanced   balance measured forward+backward cost per stage (SOTA-018): the slowest stage sets the
               pipeline's pace, so the split minimises the largest stage cost

All three return stage start indices into the piece list. The dynamic programmes are the ones
islands.sync.wrap_policy uses for FSDP units; here the items are pipeline pieces, and a piece's output is
exactly the tensor a cut after it sends (not a lower bound as for leaf modules).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from islands.measure.timing import best_seconds
from islands.sync.wrap_policy import GRAPH_SLACK, _min_bottleneck as min_bottleneck, split_cheapest_cuts

CUT_KINDS = ("equal", "graph", "balanced")


def parse_cuts(kind: str) -> str:
    if kind not in CUT_KINDS:
        raise ValueError(f"cuts={kind!r} is not a cut policy; choose one of {', '.join(CUT_KINDS)}")
    return kind


def check_stage_count(stages: int, pieces: int) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int):
        raise TypeError(f"stages must be an int, got {type(stages).__name__}")
    if not 1 <= stages <= pieces:
        raise ValueError(
            f"cannot make {stages} pipeline stages from {pieces} pieces; choose 1..{pieces} "
            "(a transformer has n_layers + 2 pieces, the digits MLP 3)"
        )


def param_bytes(piece: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in piece.parameters())


def output_bytes(pieces: list[nn.Module], example: torch.Tensor) -> list[int]:
    """Bytes of each piece's output for `example`: what a cut after that piece sends forward."""
    out, x = [], example
    with torch.no_grad():
        for piece in pieces:
            x = piece(x)
            out.append(x.numel() * x.element_size())
    return out


def _min_max_split(weights: list[int], stages: int) -> list[int]:
    cap = min_bottleneck(weights, stages)
    return split_cheapest_cuts(weights, [0] * len(weights), stages, cap)  # any split meeting the optimum


def equal_cuts(pieces: list[nn.Module], stages: int) -> list[int]:
    """Stage starts that minimise the largest stage's parameter bytes."""
    check_stage_count(stages, len(pieces))
    return _min_max_split([param_bytes(p) for p in pieces], stages)


def graph_cuts(pieces: list[nn.Module], stages: int, example: torch.Tensor, slack: float = GRAPH_SLACK) -> list[int]:
    """Stage starts within (1 + slack) x the best parameter balance whose cut tensors sum smallest (Q-3)."""
    check_stage_count(stages, len(pieces))
    weights = [param_bytes(p) for p in pieces]
    cap = min_bottleneck(weights, stages) * (1 + slack)
    return split_cheapest_cuts(weights, output_bytes(pieces, example), stages, cap)


@dataclass(frozen=True)
class PieceCost:
    """Forward+backward cost of each piece on one example micro-batch, and what it was measured in."""

    costs: list[int]
    unit: str  # "ns" (fastest wall time) or "flop"


def _fwd_bwd(piece: nn.Module, x: torch.Tensor, loss_fn: Callable | None, target) -> torch.Tensor:
    x = x.detach().requires_grad_(x.is_floating_point())
    y = piece(x)
    loss = loss_fn(y, target) if loss_fn is not None else y.float().pow(2).mean()
    loss.backward()
    return y.detach()


def piece_costs(
    pieces: list[nn.Module],
    example: torch.Tensor,
    measure: str = "time",
    repeats: int = 5,
    loss_fn: Callable | None = None,
    target: torch.Tensor | None = None,
) -> PieceCost:
    """Cost of forward+backward per piece (the last piece includes the loss when loss_fn is given).

    measure="time": the fastest of `repeats` runs after one warm-up (what SOTA-018 balances; the minimum
    resists other processes' bursts on a shared machine better than the median);
    measure='flop': torch's FLOP counter, deterministic, blind to memory-bound and small-op overheads.
    Gradients the profile leaves on parameters are cleared."""
    if measure not in ("time", "flop"):
        raise ValueError(f"measure={measure!r}: choose 'time' or 'flop'")
    inputs, x = [], example
    with torch.no_grad():
        for piece in pieces:
            inputs.append(x)
            x = piece(x)
    costs = []
    for i, (piece, inp) in enumerate(zip(pieces, inputs)):
        lf = loss_fn if i == len(pieces) - 1 else None
        if measure == "flop":
            from torch.utils.flop_counter import FlopCounterMode

            with FlopCounterMode(display=False) as counter:
                _fwd_bwd(piece, inp, lf, target)
            costs.append(int(counter.get_total_flops()))
        else:
            costs.append(round(1e9 * best_seconds(functools.partial(_fwd_bwd, piece, inp, lf, target), repeats)))
        for p in piece.parameters():
            p.grad = None
    # a zero-cost piece (a parameter-free layer under the FLOP counter) still has to go somewhere
    return PieceCost([max(c, 1) for c in costs], "ns" if measure == "time" else "flop")


def balanced_cuts(pieces: list[nn.Module], stages: int, costs: PieceCost | list[int]) -> list[int]:
    """Stage starts that minimise the largest stage's summed cost (SOTA-018)."""
    check_stage_count(stages, len(pieces))
    values = costs.costs if isinstance(costs, PieceCost) else list(costs)
    if len(values) != len(pieces) or any(c < 0 for c in values):
        raise ValueError(f"balanced cuts need one non-negative cost per piece ({len(pieces)}); got {values}")
    return _min_max_split([int(c) for c in values], stages)


def stage_sums(values: list[int], starts: list[int]) -> list[int]:
    """Per-stage totals of a per-piece quantity."""
    stops = starts[1:] + [len(values)]
    return [sum(values[a:b]) for a, b in zip(starts, stops)]


def choose_cuts(
    kind: str,
    pieces: list[nn.Module],
    stages: int,
    example: torch.Tensor,
    loss_fn: Callable | None = None,
    target: torch.Tensor | None = None,
) -> list[int]:
    """The starts for one policy by name; 'balanced' measures time on `example` (one micro-batch)."""
    kind = parse_cuts(kind)
    if kind == "equal":
        return equal_cuts(pieces, stages)
    if kind == "graph":
        return graph_cuts(pieces, stages, example[:1])
    return balanced_cuts(pieces, stages, piece_costs(pieces, example, "time", loss_fn=loss_fn, target=target))
