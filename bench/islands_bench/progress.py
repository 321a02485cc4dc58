"""Progress of a long experiment: which arm runs now, how many are done and left, and about how long is left.

An arm is one training job of an experiment (`BenchContext.train`, `train_elastic`, or a block under
`ctx.arm(label)`). How many arms there will be comes from the experiment (`ctx.plan(n)`), else from the
previous result of the same experiment and variant; how long each takes comes from the arms already
finished in this invocation, else from that previous result. The harness prints one line per arm start
and end, e.g.

    [3/8] diloco-H100 · done 2 in 1m40s · about 4m10s left

A previous result tells each arm's duration in its "arm_times" (written since this module exists) or,
for older results, in its runs' wall_seconds, with the rest of the invocation's time (process start-up,
probes) spread evenly over the runs. Arms reused with --reuse count as done at once and say nothing about
speed. When this invocation has finished arms that the previous one also ran, the previous durations are
scaled by how much faster or slower this machine turned out on those.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


def clock(seconds: float) -> str:
    """45s, 1m40s, 1h05m."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


@dataclass
class Previous:
    """What the previous result of the same experiment says: how many arms, in which order, how long each."""

    count: int
    seconds: dict[str, float]  # label -> seconds, for the arms whose duration is known


def previous_arms(result: dict) -> Previous | None:
    """The arms of a previous result.json (its "arm_times", else its "runs"), or None if it tells nothing."""
    if not isinstance(result, dict):
        return None
    arms = result.get("arm_times")
    if isinstance(arms, list) and arms:
        known = {}
        for a in arms:
            if isinstance(a, dict) and not a.get("reused") and _number(a.get("seconds")) is not None:
                known[str(a.get("label", ""))] = _number(a["seconds"])
        return Previous(count=len(arms), seconds=known)
    runs = [r for r in result.get("runs") or [] if isinstance(r, dict)] if isinstance(result.get("runs"), list) else []
    if not runs:
        return None
    walls = {}
    for r in runs:
        summary = r.get("summary") if isinstance(r.get("summary"), dict) else {}
        wall = _number(summary.get("wall_seconds"))
        if wall is not None:
            walls[str(r.get("label", ""))] = wall
    total = _number(result.get("seconds"))
    if walls and total is not None and total > sum(walls.values()):
        share = (total - sum(walls.values())) / len(runs)  # start-up, probes: what wall_seconds leaves out
        walls = {label: s + share for label, s in walls.items()}
    return Previous(count=len(runs), seconds=walls)


def load_previous(path: Path) -> Previous | None:
    """previous_arms of the result.json at path; None when there is none or it cannot be read."""
    try:
        return previous_arms(json.loads(Path(path).read_text()))
    except (OSError, ValueError):
        return None


@dataclass
class Arm:
    label: str
    seconds: float
    reused: bool = False


@dataclass
class Progress:
    """Counts arms and estimates the time left; each method returns the line to print."""

    planned: int | None = None  # ctx.plan(n)
    previous: Previous | None = None
    now: Callable[[], float] = time.monotonic
    done: list[Arm] = field(default_factory=list)
    current: str | None = None
    _began: float | None = None
    _arm_began: float = 0.0

    def plan(self, arms: int) -> None:
        if isinstance(arms, bool) or not isinstance(arms, int) or arms < 1:
            raise ValueError(f"plan: the number of arms must be a positive integer, got {arms!r}")
        self.planned = arms

    def _tick(self) -> float:
        t = self.now()
        if self._began is None:
            self._began = t
        return t

    @property
    def total(self) -> int | None:
        """Arms expected in all: planned, else the previous result's count; never fewer than seen so far."""
        expected = self.planned or (self.previous.count if self.previous else None)
        seen = len(self.done) + (self.current is not None)
        return None if expected is None else max(expected, seen)

    def _scale(self) -> float:
        """This invocation's speed relative to the previous one, on the arms both ran (1 when none)."""
        if not self.previous:
            return 1.0
        pairs = [
            (a.seconds, self.previous.seconds[a.label])
            for a in self.done
            if not a.reused and self.previous.seconds.get(a.label)
        ]
        now, then = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
        return now / then if pairs and then > 0 else 1.0

    def seconds_left(self) -> float | None:
        """About how long the arms not yet finished (the current one included) will take; None if unknown."""
        total = self.total
        if total is None:
            return None
        slots = total - len(self.done)
        if slots <= 0:
            return 0.0
        measured = [a.seconds for a in self.done if not a.reused]
        scale = self._scale()
        before = self.previous.seconds if self.previous else {}
        default = (
            sum(measured) / len(measured)
            if measured
            else scale * sum(before.values()) / len(before)
            if before
            else None
        )
        finished = {a.label for a in self.done}
        # Labels the previous invocation ran that this one has not finished: likely the arms still to come.
        pool = [label for label in before if label not in finished and label != self.current]
        left = 0.0
        for i in range(slots):
            if i == 0 and self.current is not None:
                label = self.current if self.current in before else None
            else:
                label = pool.pop(0) if pool else None
            guess = scale * before[label] if label is not None else default
            if guess is None:
                return None
            left += guess
        return left

    def _line(self, head: str) -> str:
        total = self.total
        index = len(self.done) + (self.current is not None)
        elapsed = self.now() - self._began if self._began is not None else 0.0
        count = f"{index}/{total if total is not None else '?'}"
        parts = [f"[{count}] {head}", f"done {len(self.done)} in {clock(elapsed)}"]
        left = self.seconds_left()
        if total is not None and len(self.done) >= total:
            parts.append("all arms done")
        elif left is not None:
            parts.append(f"about {clock(left)} left")
        return " · ".join(parts)

    def start(self, label: str) -> str:
        self._arm_began = self._tick()
        self.current = label
        return self._line(label)

    def finish(self, label: str | None = None) -> str:
        label = label or self.current or "?"
        seconds = self._tick() - self._arm_began
        self.current = None
        self.done.append(Arm(label, seconds))
        return self._line(f"{label} finished in {clock(seconds)}")

    def fail(self, label: str | None = None) -> str:
        label = label or self.current or "?"
        seconds = self._tick() - self._arm_began
        self.current = None
        return f"{label} failed after {clock(seconds)}"

    def reused(self, label: str) -> str:
        """An arm read back with --reuse: done at once."""
        self._tick()
        self.done.append(Arm(label, 0.0, reused=True))
        return self._line(f"{label} reused (--reuse)")

    def record(self) -> list[dict]:
        """The arms of this invocation, for result.json's "arm_times" (the next run's estimate)."""
        return [{"label": a.label, "seconds": round(a.seconds, 3), "reused": a.reused} for a in self.done]
