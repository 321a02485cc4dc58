"""A slower machine on one host: some islands (or ranks) compute `factor` times slower than the rest.

    step_fn = SlowStep(ForwardBackward(), factor=2.0)      this process's forward and backward take 2x as long
    Trainer(..., step_fn=slow_step(step_fn, parse_slowdown("1=2.0"), rank=world.rank, island=world.island))
    islands train --workers 2 --islands 2 --outer diloco:adapt=speed --world.slowdown 1=2.0

After each forward and backward SlowStep sleeps (factor - 1) times that call's measured duration, so the call takes
`factor` times as long on this process and on nothing else. What is computed is unchanged bit for bit: only time
passes. Sleeping frees the core, so on a shared machine the other processes do not slow down with it; the measured
ratio is the factor only while the compute itself is not crowded out (the bench reports the step times it got).

The spec `world.slowdown` is comma-separated `target=factor` pairs: `1=2.0` or `island1=2.0` slows every worker of
island 1, `rank3=1.5` slows rank 3 alone (a slow worker inside an island holds up its DDP steps: one island-wide
slow worker). A process both named by its island and its rank takes the larger factor. Factors are >= 1.

`floor=S` (seconds) emulates hosts of their own on a shared one: every process's forward and backward lasts at least
S seconds (it sleeps the rest), times its factor. When S is above the real compute time, the islands' speeds are
set by S and the factors alone, not by how much CPU the other processes on the host leave them (on a loaded
machine a process that sleeps half the time gets more of the CPU than one that never does, which shrinks a
sleep-made 2x to less). The real computation still runs every step; only its duration is padded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar, cast

F = TypeVar("F", bound=Callable)


class SlowdownError(ValueError):
    """A bad slowdown spec; the message names the piece and the right form."""


FORM = (
    "comma-separated target=factor pairs, target an island (1 or island1) or a rank (rank3), factor >= 1, "
    "and optionally floor=SECONDS (each step lasts at least that long): '1=2.0' or '1=2.0,floor=0.05'"
)
FLOOR = ("floor", 0)  # the key floor=S is kept under, beside the (kind, index) targets


def parse_slowdown(text: str) -> dict[tuple[str, int], float]:
    """'1=2.0,rank3=1.5,floor=0.05' -> {("island", 1): 2.0, ("rank", 3): 1.5, ("floor", 0): 0.05}; "" -> {}."""
    out: dict[tuple[str, int], float] = {}
    for piece in (p.strip() for p in (text or "").split(",")):
        if not piece:
            continue
        target, eq, value = piece.partition("=")
        target = target.strip().lower()
        if target == "floor":
            try:
                floor = float(value)
            except ValueError:
                floor = -1.0
            if not eq or not 0 <= floor < float("inf") or FLOOR in out:
                raise SlowdownError(f"slowdown piece {piece!r}: floor takes seconds >= 0, once; use {FORM}")
            out[FLOOR] = floor
            continue
        kind = "rank" if target.startswith("rank") else "island"
        number = target[len(kind) :] if target.startswith(kind) else target
        try:
            index, factor = int(number), float(value)
        except ValueError:
            raise SlowdownError(f"slowdown piece {piece!r} is not target=factor; use {FORM}") from None
        if not eq or index < 0:
            raise SlowdownError(f"slowdown piece {piece!r} is not target=factor; use {FORM}")
        if not factor >= 1 or factor == float("inf"):
            raise SlowdownError(
                f"slowdown factor in {piece!r} must be a finite number >= 1 (1 = full speed); got {value.strip()!r}"
            )
        if (kind, index) in out:
            raise SlowdownError(f"slowdown names {kind} {index} twice; give it once")
        out[(kind, index)] = factor
    return out


def check_slowdown(slowdown: dict[tuple[str, int], float], islands: int, workers: int) -> None:
    """Every target exists in a world of `workers` ranks in `islands` islands."""
    for kind, index in slowdown:
        if (kind, index) == FLOOR:
            continue
        limit = islands if kind == "island" else workers
        if index >= limit:
            raise SlowdownError(
                f"slowdown names {kind} {index}, but the job has {limit} {kind}s (0..{limit - 1}); {FORM}"
            )


def factor_for(slowdown: dict[tuple[str, int], float], rank: int, island: int) -> float:
    return max(slowdown.get(("island", island), 1.0), slowdown.get(("rank", rank), 1.0))


class SlowStep:
    """A step function (islands.memory.ForwardBackward, or any callable) whose every call takes `factor` times as
    long: it sleeps (factor - 1) x the call's own duration after it (`floor`: the duration counted as at least
    that many seconds). Other attributes are the wrapped step's."""

    def __init__(
        self,
        step_fn: Callable,
        factor: float,
        floor: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
        timer: Callable[[], float] = time.perf_counter,
    ):
        if not factor >= 1 or factor == float("inf"):
            raise SlowdownError(f"SlowStep factor must be a finite number >= 1; got {factor!r}")
        if not 0 <= floor < float("inf"):
            raise SlowdownError(f"SlowStep floor must be seconds >= 0; got {floor!r}")
        self.step_fn, self.factor, self.floor = step_fn, float(factor), float(floor)
        self._sleep, self._timer = sleep, timer
        self.slept = 0.0  # seconds slept so far
        self.worked = 0.0  # seconds the wrapped calls took

    def __call__(self, *args, **kwargs):
        start = self._timer()
        out = self.step_fn(*args, **kwargs)
        took = self._timer() - start
        self.worked += took
        pause = self.factor * max(took, self.floor) - took  # factor x the step, padded to the floor first
        if pause > 0:
            self._sleep(pause)
            self.slept += pause
        return out

    def __getattr__(self, name):  # micro_batch, precision, plan, record(): the wrapped step's
        if name == "step_fn":
            raise AttributeError(name)
        return getattr(self.step_fn, name)


def slow_step(step_fn: F, slowdown: dict[tuple[str, int], float], rank: int, island: int) -> F:
    """`step_fn` slowed by this process's factor, or `step_fn` itself at full speed."""
    factor, floor = factor_for(slowdown, rank, island), slowdown.get(FLOOR, 0.0)
    if factor > 1 or floor > 0:
        return cast(F, SlowStep(step_fn, factor, floor))  # it stands in for step_fn: the other attributes are its
    return step_fn
