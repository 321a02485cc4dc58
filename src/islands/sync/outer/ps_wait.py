"""How long a parameter server's window waits for its quorum (issue #36; `ps:quorum=M,wait=...`).

A push that leaves its window short of the quorum is held; the window steps when the quorum is in, or at the
deadline a `WindowWait` gives, with what it holds. The server that times the window (ps_link.ServerLoop in thread
mode, ps_service.ShardServer.hold per shard in process mode) tells the rule when each island's push arrived and
when it was answered, on its own clock (virtual under ps_link.VirtualClock, so simulations stay deterministic).

- `FixedWait(seconds)` (`wait=SECONDS`): every window waits that long.
- `PacedWait()` (`wait=auto`): the server learns each island's turnaround, the time from its answer leaving to its
  next push arriving (its compute, plus the answer's and the push's transfer on its link), and a window waits only
  for the islands due soon: those whose next push is expected within `reach` of the fastest island's turnaround
  after the window opened, each until its expected arrival plus `margin` of its own turnaround. Equal islands on a
  slow link are waited for (the remote island is late by its transfers, each round alike: session 36 measured 2.8
  s of a 10 s round at 20 Mbit/s, where a fixed 1 s wait lost it every window), an island 2x or 4x slower is not,
  except in the windows it would join anyway. A first round (from the start, or a pull, to the first push) holds
  start-up time, so it is not a turnaround: until an island has one, its first round less the start-up other
  islands showed stands in; one that has not pushed at all is due a fastest turnaround (or, before any, the
  fastest first round) after it started, and if that falls within the reach it is waited for up to the reach (a
  restarted island is a new one on the servers, started later than the others: before session 39 every window
  opened during its first round waited the reach for it); with nothing known, up to `first` seconds.

A push still on its way in at the deadline is waited for in both (its header is in: ps_link.FirstCome,
ShardServer.hold).

An island that starts while the others are mid-round (in an elastic job, a restarted island: a new island on the
servers) would come due a part of a round after them, and a rule that keeps equal islands together then holds the
others' next window for it. PacedWait also says when the others' next window will have stepped (`JoinAlignment`):
the shard servers hold such a pull until then and answer it with that window's model, so the joiner idles instead
(as DiLoCo's joiner waits for a round boundary) and its rounds run beside theirs. Session 39 measured the cost it
removes: on the byte LM's churn with freezes, each restart held the healthy islands' next window 2.7-3.3 s.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from typing import Protocol, runtime_checkable


@runtime_checkable
class WindowWait(Protocol):
    """When a held window steps without the rest of its quorum. Times are the server's clock's."""

    def started(self, island: int, when: float) -> None:
        """`island` started training at `when` (the loop's start, or its pull: its first round's time includes its
        start-up, so it says little of its pace)."""

    def arrived(self, island: int, when: float) -> None:
        """A push of `island` arrived at `when`."""

    def answered(self, island: int, when: float) -> None:
        """`island`'s answer left at `when` (its next round starts)."""

    def deadline(self, opened: float, missing: Iterable[int]) -> float:
        """When a window whose first held push came at `opened` steps without `missing` (live islands not in it)."""
        ...


@runtime_checkable
class JoinAlignment(Protocol):
    """A rule that can tell when the islands already training will next step, so that an island starting beside
    them (a restarted one: a new island on the servers) can start its round with theirs."""

    def align_until(self, now: float, others: Iterable[int]) -> float:
        """How long a pull arriving at `now` may be held for the window of `others` (the live islands but the
        puller) to step: `now` when there is nothing to align with."""
        ...


class FixedWait:
    """Every window waits `seconds` after its first held push (`wait=SECONDS`)."""

    def __init__(self, seconds: float):
        if not seconds > 0:
            raise ValueError(f"wait must be > 0 seconds (or auto), got {seconds}")
        self.seconds = float(seconds)

    def started(self, island: int, when: float) -> None:
        pass

    def arrived(self, island: int, when: float) -> None:
        pass

    def answered(self, island: int, when: float) -> None:
        pass

    def deadline(self, opened: float, missing: Iterable[int]) -> float:
        return opened + self.seconds

    def __repr__(self) -> str:
        return f"FixedWait({self.seconds:g})"


# PacedWait's defaults: islands due within 0.35 of the fastest turnaround are waited for (a remote island on a
# 20 Mbit/s link came 0.28 of a round late, session 36), each with 10% of its own turnaround for jitter; 30 s for an
# island not yet seen twice (a first window of islands started together); the median of the last 5 turnarounds
# (swept on a virtual clock in session 41, scripts/ps_wait_tuning.py: reach 0.2-0.5 x margin 0.1-0.25 differ by less
# than the seeds do; docs/parameter-server.md, "Tuning the reach and the margin")
REACH, MARGIN, FIRST_S, HISTORY = 0.35, 0.1, 30.0, 5


class PacedWait:
    """A window waits only for the islands due soon, by their turnarounds (module docstring; `wait=auto`)."""

    def __init__(self, reach: float = REACH, margin: float = MARGIN, first: float = FIRST_S, history: int = HISTORY):
        if not (reach > 0 and margin >= 0 and first > 0 and history >= 1):
            raise ValueError(
                f"PacedWait needs reach > 0, margin >= 0, first > 0 and history >= 1; got {reach}, {margin}, {first}, "
                f"{history}"
            )
        self.reach, self.margin, self.first, self.history = float(reach), float(margin), float(first), int(history)
        self.sent: dict[int, float] = {}  # island -> when its last answer left (or it started)
        self.turns: dict[int, deque[float]] = {}  # island -> its last turnarounds, answer to push
        self.firsts: dict[int, float] = {}  # island -> its first round's time, start-up included
        self.starting: set[int] = set()  # islands whose next push ends their first round

    def started(self, island: int, when: float) -> None:
        self.sent[island] = when
        self.starting.add(island)

    def arrived(self, island: int, when: float) -> None:
        since = self.sent.pop(island, None)
        if since is None:
            return
        if island in self.starting:  # a first round: start-up in it, kept apart from the pace
            self.starting.discard(island)
            self.firsts[island] = max(when - since, 0.0)
        else:
            self.turns.setdefault(island, deque(maxlen=self.history)).append(max(when - since, 0.0))

    def answered(self, island: int, when: float) -> None:
        self.sent[island] = when

    def turnaround(self, island: int) -> float | None:
        turns = self.turns.get(island)
        return statistics.median(turns) if turns else None

    def fastest(self) -> float | None:
        """The fastest island's turnaround; before any island has one, the fastest first round (start-up and all)."""
        known = [t for t in (self.turnaround(i) for i in self.turns) if t is not None and t > 0]
        known = known or [t for t in self.firsts.values() if t > 0]
        return min(known) if known else None

    def expected(self, island: int) -> float | None:
        """`island`'s turnaround, or, before it has one, its first round less the start-up the islands measured
        so far spent in theirs (first round minus turnaround, the least of them: islands that start together)."""
        turn = self.turnaround(island)
        if turn is not None or island not in self.firsts:
            return turn
        startups = [self.firsts[i] - t for i in self.firsts if (t := self.turnaround(i)) is not None]
        return max(self.firsts[island] - (min(startups) if startups else 0.0), 0.0)

    def deadline(self, opened: float, missing: Iterable[int]) -> float:
        fastest = self.fastest()
        horizon = opened + self.reach * fastest if fastest is not None else opened
        deadline = opened
        for island in missing:
            turn, since = self.expected(island), self.sent.get(island)
            if fastest is None or since is None:  # nothing known yet, or never started: wait up to `first`
                deadline = max(deadline, opened + self.first)
                continue
            if turn is None:  # started, not pushed yet: about as fast as the fastest, so due a fastest round on
                if since + fastest <= horizon:  # islands started together: due now; one started later is not yet
                    deadline = max(deadline, horizon)
                continue
            due = since + turn
            if due <= horizon:
                deadline = max(deadline, due + self.margin * turn)
        return deadline

    def align_until(self, now: float, others: Iterable[int]) -> float:
        """Until the others' next window can have stepped: the first of them due (their answer out plus their
        turnaround) opens it, and it waits at most the reach past that. `now` while any of them has no turnaround
        yet (the job is starting: everyone pulls together), or when they are overdue (frozen, or past their pace)."""
        others = list(others)
        fastest = self.fastest()
        if not others or fastest is None:
            return now
        dues = []
        for island in others:
            turn, since = self.turnaround(island), self.sent.get(island)
            if turn is None or since is None:
                return now
            dues.append(since + turn)
        until = min(dues) + self.reach * fastest
        return until if now < until <= now + fastest * (1.0 + self.reach) else now

    def __repr__(self) -> str:
        return f"PacedWait(reach={self.reach:g}, margin={self.margin:g}, first={self.first:g})"


def window_wait(wait: float | str | WindowWait | None) -> WindowWait | None:
    """The rule `ParameterServer(wait=...)` and the spec's `wait=` name: None or 0 for none (every push answered at
    once), seconds for FixedWait, "auto" for PacedWait, or a WindowWait as it is."""
    if wait is None or isinstance(wait, WindowWait):
        return wait
    if isinstance(wait, str):
        if wait != "auto":
            raise ValueError(f"wait must be seconds >= 0 or auto, got {wait!r}")
        return PacedWait()
    if isinstance(wait, bool) or not wait >= 0:
        raise ValueError(f"wait must be >= 0 seconds (how long a push waits for its window's quorum), got {wait}")
    return FixedWait(wait) if wait > 0 else None
