"""SOTA-019: pick the micro-batch count M by weighing idle time against held activations.

For a batch of B split into M micro-batches of b = B/M on K stages:
    idle share      (K-1)/(M+K-1)                                   (SOTA-017; falls with M)
    step time       (M+K-1) x t(b), t(b) the slowest stage's forward+backward of one micro-batch
                    (with t proportional to b this is B t(1) / (1 - idle share); a fixed cost per
                    micro-batch, messages and small kernels, makes very large M slow again)
    held bytes      max over stages of (micro-batches in flight at once) x bytes one holds:
                    gpipe holds all M, 1f1b at most K-s on stage s
The choice: the M with the shortest predicted step among those whose held bytes fit the budget. With no
fixed per-micro-batch cost that is the largest M that fits, the registry's claim.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from islands.measure.timing import best_seconds
from islands.parallel.pipeline.memory import SavedTensorMeter
from islands.parallel.pipeline.schedule import bubble_fraction, peak_in_flight, schedule_for


@dataclass(frozen=True)
class MicrobatchOption:
    microbatches: int
    bubble: float
    held_bytes: int  # worst stage
    predicted_step: float  # seconds, or units of t(1) when no times were given
    fits: bool


@dataclass(frozen=True)
class MicrobatchChoice:
    microbatches: int
    budget_bytes: float
    options: list[MicrobatchOption] = field(default_factory=list)

    def option(self) -> MicrobatchOption:
        return next(o for o in self.options if o.microbatches == self.microbatches)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def held_bytes(schedule: str, stages: int, microbatches: int, per_microbatch: list[int]) -> int:
    """Worst stage's peak: micro-batches that stage holds at once x what one of them holds there."""
    if len(per_microbatch) != stages:
        raise ValueError(f"need one byte count per stage ({stages}), got {len(per_microbatch)}")
    plan = schedule_for(schedule)
    return max(peak_in_flight(plan(s, stages, microbatches)) * per_microbatch[s] for s in range(stages))


def choose_microbatches(
    stages: int,
    batch: int,
    schedule: str,
    bytes_per_microbatch: Callable[[int], list[int]] | Mapping[int, list[int]],
    budget_bytes: float = math.inf,
    microbatch_seconds: Callable[[int], float] | Mapping[int, float] | None = None,
    candidates: list[int] | None = None,
) -> MicrobatchChoice:
    """bytes_per_microbatch(b): bytes each stage holds for one micro-batch of b samples;
    microbatch_seconds(b): the slowest stage's forward+backward for b samples (default: proportional to b)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be > 0 (math.inf for no budget), got {budget_bytes}")
    cands = candidates or divisors(batch)
    bad = [m for m in cands if m < 1 or batch % m]
    if bad:
        raise ValueError(f"micro-batch counts {bad} do not divide the batch of {batch}; divisors: {divisors(batch)}")

    def look(f, b):
        return f[b] if isinstance(f, Mapping) else f(b)

    options = []
    for m in sorted(cands):
        b = batch // m
        per_mb = [int(v) for v in look(bytes_per_microbatch, b)]
        held = held_bytes(schedule, stages, m, per_mb)
        t = look(microbatch_seconds, b) if microbatch_seconds is not None else float(b)
        options.append(
            MicrobatchOption(m, bubble_fraction(stages, m), held, (m + stages - 1) * t, held <= budget_bytes)
        )
    fitting = [o for o in options if o.fits]
    if not fitting:
        least = min(options, key=lambda o: o.held_bytes)
        raise ValueError(
            f"no micro-batch count fits the activation budget of {budget_bytes / 1e6:.3f} MB: the least "
            f"held is {least.held_bytes / 1e6:.3f} MB at M={least.microbatches} ({schedule}); raise the "
            "budget, use schedule 1f1b, more stages or a smaller batch"
        )
    # shortest predicted step; among equals the larger M (smaller idle share)
    best = min(fitting, key=lambda o: (o.predicted_step, -o.microbatches))
    return MicrobatchChoice(best.microbatches, budget_bytes, options)


def profile_microbatches(
    pieces: list[nn.Module],
    starts: list[int],
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable,
    sizes: list[int],
    time_it: bool = True,
    repeats: int = 3,
) -> dict[int, tuple[list[int], float]]:
    """For each micro-batch size b: (bytes each stage holds for one micro-batch, as the runner counts
    them, and the slowest stage's forward+backward seconds, the fastest of `repeats` runs after a
    warm-up). Runs every stage locally on x[:b]."""
    stops = starts[1:] + [len(pieces)]
    params = [p for piece in pieces for p in piece.parameters()]
    last = len(starts) - 1

    def run(s: int, h: torch.Tensor, b: int, meter: SavedTensorMeter | None):
        inp = h.detach().requires_grad_(h.is_floating_point())
        with meter.forward_of(0) if meter is not None else _nothing():
            o = inp
            for piece in pieces[starts[s] : stops[s]]:
                o = piece(o)
            loss = loss_fn(o, y[:b]) if s == last else o.float().pow(2).mean()
        if meter is not None:
            meter.hold(0, inp)
            if s != last:
                meter.hold(0, o)
        loss.backward()
        return o.detach()

    out = {}
    for b in sizes:
        h = x[:b].clone()
        per_stage, seconds = [], []
        for s in range(len(starts)):
            meter = SavedTensorMeter(params)
            nxt = run(s, h, b, meter)  # also the warm-up
            per_stage.append(meter.per_microbatch[0])
            if time_it:  # the metered run above was the warm-up
                seconds.append(best_seconds(functools.partial(run, s, h, b, None), repeats, warm=False))
            h = nxt
        for p in params:
            p.grad = None
        out[b] = (per_stage, max(seconds) if time_it else float(b))
    return out


@contextlib.contextmanager
def _nothing():
    yield
