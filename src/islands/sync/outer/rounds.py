"""DiLoCo's schedule part: when each fragment's exchange starts and how its result lands. The base, plain rounds and
the streaming fragments; overlapped rounds are in eager.py, speed-adaptive rounds in adaptive.py.

    Rounds()                                     every H steps all parameters exchange, blocking (plain DiLoCo)
    Fragments(fragments=F, tau=T, merge=0.5, landing="mix")
                                                 streaming DiLoCo (LIT-214): fragment p starts its exchange at steps
                                                 (p+1)*H/F + k*H, lands tau steps later while inner steps continue,
                                                 and the landed global fragment is merged into the local one
    Overlapped(mode="eager"|"delayed", fragments=F)        eager.py: each exchange lands one whole round late
    Adaptive(mode="speed"|"deadline", deadline=0, overlap="none")  adaptive.py: islands of different speeds

A schedule is bound to its DiLoCo at wrap (`bind`) and reads the strategy's global model, exchange and outer step
through it; its own state (exchanges in flight, sends per fragment, what a landing needs) is its state_dict, whose
keys are DiLoCo's checkpoint keys of before the parts ("inflight", "sends", "at_send", "start_at", "adapt", ...),
so a checkpoint written before loads unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch

from islands.sync.outer.exchange import Exchange, Pending
from islands.sync.outer.flat import FlatView, fragment_bounds
from islands.sync.outer.outer_opt import OuterStep

LANDINGS = ("mix", "replay")


class ScheduleHost(Protocol):
    """What a schedule reads of the DiLoCo it is bound to (the strategy, set up at wrap): its flat global and local
    models and buffers, exchange, outer step and clock. A protocol, not DiLoCo itself: diloco.py imports this
    module, and the layering test refuses the cycle an import back would make."""

    inner_steps: int
    global_flat: torch.Tensor
    local: FlatView
    global_buffers: list[torch.Tensor]
    local_buffers: list[torch.Tensor]
    buffer_policy: str
    exchange: Exchange
    outer: OuterStep
    comm: Any  # the cross-island Comm (OuterStrategy.wrap): a Collectives, or LoneComm alone
    membership: Any  # the elastic membership when the strategy holds it (OuterStrategy.wrap), else None
    clock: int

    def outer_step(self, p: int, mean_delta: torch.Tensor) -> None: ...

    def outer_lr_factor(self) -> float: ...

    def adopt_global(self, lo: int = 0, hi: int | None = None) -> None: ...

    def inner_state_step(self) -> None: ...

    def synced(self) -> None: ...

    def synced_buffers(self) -> None: ...


class Schedule(ABC):
    """What every schedule shares: fragments, their bounds and offsets, the exchanges in flight, sends per fragment.
    `d`: the DiLoCo it is bound to (bind)."""

    d: ScheduleHost  # set by bind (at wrap); every method that reads it runs after

    def __init__(self, fragments: int = 1):
        if not isinstance(fragments, int) or fragments < 1:
            raise ValueError(f"fragments must be an int >= 1, got {fragments!r}")
        self.fragments = fragments
        self.inner_steps = 0
        self.bounds: list[tuple[int, int]] = []
        self.offsets: list[int] = []
        self.pending: list[tuple[int, int, Pending]] = []  # (fragment, step count it lands at, exchange)
        self.sends = [0] * fragments  # completed sends per fragment, for tests and reports

    # ---- what DiLoCo asks before it runs --------------------------------------------------------------
    def check(self, inner_steps: int) -> None:
        """Take DiLoCo's H (its constructor calls this): ValueError where this schedule cannot run rounds of
        `inner_steps` steps, else the fragments' offsets (`starting` answers from here on)."""
        if inner_steps < 1 or self.fragments > inner_steps:
            raise ValueError(
                f"need 1 <= fragments <= inner_steps; got fragments={self.fragments}, inner_steps={inner_steps}"
            )
        self.inner_steps = int(inner_steps)
        # fragment p's first send is at step count (p+1)*H//F, then every H steps (staggered, LIT-214)
        self.offsets = [(p + 1) * self.inner_steps // self.fragments for p in range(self.fragments)]

    def options(self) -> dict:
        """This schedule in the spec's words (fragments, tau, overlap, adapt), for messages and reports."""
        return {"fragments": self.fragments, "tau": 0, "overlap": "none", "adapt": "none"}

    def plain(self) -> bool:
        """Whole-model blocking rounds (what sync_inner_state and sharded parameters need)."""
        return self.options() == {"fragments": 1, "tau": 0, "overlap": "none", "adapt": "none"}

    def refusal(self, exchange, sync_inner_state: bool) -> str | None:
        """Why this schedule cannot run with this exchange and sync_inner_state; None when it can."""
        if sync_inner_state and not self.plain():
            return "sync_inner_state needs plain rounds (schedule=Rounds(): fragments=1, tau=0, no overlap)"
        return None

    def elastic_refusal(self) -> str | None:
        """Why this schedule cannot run in an elastic job (members come and go); None when it can."""
        return None

    def bind(self, d: ScheduleHost, world) -> None:
        """At wrap (DiLoCo.setup): the strategy, its flat model and the world are known."""
        self.d = d
        self.check(d.inner_steps)
        self.bounds = fragment_bounds(d.global_flat.numel(), self.fragments)

    def starting(self, done: int) -> list[int]:
        """Fragments whose exchange starts after `done` steps (the schedule, without the final flush)."""
        return [p for p, o in enumerate(self.offsets) if done >= o and (done - o) % self.inner_steps == 0]

    # ---- the hooks ------------------------------------------------------------------------------------
    def on_batch(self, batch) -> None:
        """Before a step; nothing by default (a schedule that meters steps overrides it)."""
        return

    @abstractmethod
    def after_step(self, done: int) -> None:
        """After the loop's step `done`: start, land or merge the exchanges this schedule plans there."""

    def next_step(self, done: int) -> int:
        return done

    def has_pending(self) -> bool:
        return bool(self.pending)

    def joined(self) -> None:
        """After an elastic joiner entered; nothing by default."""
        return

    @abstractmethod
    def final_sync(self) -> None:
        """At finish: land what is in flight and synchronise whatever has work since its last exchange."""

    def report(self) -> dict:
        return {}

    # ---- helpers ------------------------------------------------------------------------------------
    def _adopt(self, p: int, mean_delta: torch.Tensor) -> None:
        """The outer step on fragment p; the local fragment restarts from the new global one."""
        lo, hi = self.bounds[p]
        self.d.outer_step(p, mean_delta)
        self.d.adopt_global(lo, hi)
        self.d.inner_state_step()

    def _send_blocking(self, p: int) -> None:
        lo, hi = self.bounds[p]
        delta = self.d.global_flat[lo:hi] - self.d.local.read(lo, hi)
        self.sends[p] += 1
        self._adopt(p, self.d.exchange.mean(self.d.comm, delta, name=f"fragment{p}"))

    # ---- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        # Exchanges in flight were started on every rank: wait for them here and keep their results (first: an
        # exchange in flight still updates the compressor's error feedback the exchange saves after this).
        inflight = [(p, lands, pending.wait().clone()) for p, lands, pending in self.pending]
        self.pending = [(p, lands, Pending(value=v)) for p, lands, v in inflight]
        return {"inflight": inflight, "sends": list(self.sends), "at_send": {}, "start_at": {}}

    def load_state_dict(self, state: dict) -> None:
        self.pending = [
            (int(p), int(lands), Pending(value=v.to(torch.float32).clone()))
            for p, lands, v in state.get("inflight", [])
        ]
        self.sends = list(state.get("sends", [0] * self.fragments))


class Fragments(Schedule):
    """Streaming DiLoCo's schedule (LIT-214). `fragments` F: the flat parameters split into F equal fragments,
    fragment p exchanged every H steps at offset (p+1)*H/F. `tau`: inner steps each exchange overlaps with (0 =
    blocking). `merge`: landing=mix's weight kept of the local fragment when the new global one lands (local <-
    merge*local + (1-merge)*global); `landing`: mix | replay (local <- global + the tau steps taken since the send,
    so no work is counted twice or dropped). Fragments(1, 0) is plain DiLoCo (Rounds)."""

    def __init__(self, fragments: int = 4, tau: int = 1, merge: float = 0.5, landing: str = "mix"):
        super().__init__(fragments)
        if landing not in LANDINGS:
            raise ValueError(f"landing must be 'mix' or 'replay', got {landing!r}")
        if not 0 <= merge < 1:
            raise ValueError(f"merge must be in [0, 1), got {merge}")
        if tau < 0:
            raise ValueError(f"tau must be >= 0, got {tau}")
        self.tau, self.merge, self.landing = int(tau), float(merge), landing
        self.at_send: dict[int, torch.Tensor] = {}  # landing=replay: the local fragment when its delta left

    def check(self, inner_steps: int) -> None:
        super().check(inner_steps)
        if not 0 <= self.tau < inner_steps:
            raise ValueError(f"tau must be in [0, inner_steps); got tau={self.tau}, inner_steps={inner_steps}")

    def options(self) -> dict:
        return {**super().options(), "tau": self.tau}

    def after_step(self, done: int) -> None:
        d = self.d
        for entry in list(self.pending):
            p, lands, pending = entry
            if lands <= done:
                self.pending.remove(entry)
                self._land(p, pending.wait())
        starting = self.starting(done)
        for p in starting:
            self._send(p)
        if starting and self.fragments == 1 and self.tau == 0:
            d.synced()  # a blocking round of the whole model: every island's work is in
        elif starting and starting[-1] == self.fragments - 1:
            d.synced_buffers()  # streaming: buffers once per cycle (parameters never all at once)

    def _send(self, p: int) -> None:
        if self.tau == 0:
            self._send_blocking(p)
            return
        d, (lo, hi) = self.d, self.bounds[p]
        delta = d.global_flat[lo:hi] - d.local.read(lo, hi)
        self.sends[p] += 1
        if self.landing == "replay":
            self.at_send[p] = d.local.read(lo, hi)
        self.pending.append((p, d.clock + self.tau, d.exchange.start(d.comm, delta, name=f"fragment{p}")))

    def _land(self, p: int, mean_delta: torch.Tensor) -> None:
        """A fragment's exchange lands tau steps after it left: the outer step, then the local fragment keeps part
        of the island's work since (mix) or all of it (replay)."""
        d, (lo, hi) = self.d, self.bounds[p]
        d.outer_step(p, mean_delta)
        if self.landing == "replay":  # new global + exactly the tau steps taken since the delta left
            x = d.local.read(lo, hi).sub_(self.at_send.pop(p)).add_(d.global_flat[lo:hi])
        else:  # the island kept training for tau steps: keep part of that work (LIT-214's merge)
            x = d.local.read(lo, hi).mul_(self.merge).add_(d.global_flat[lo:hi], alpha=1 - self.merge)
        d.local.write(x, lo)

    def joined(self) -> None:
        """Elastic joiner (after local <- global): landing=replay measures its own steps from here."""
        for p in list(self.at_send):
            lo, hi = self.bounds[p]
            self.at_send[p] = self.d.local.read(lo, hi)

    def final_sync(self) -> None:
        """Land what is in flight, then sync every fragment, blocking: the global model holds all work."""
        for p, _, pending in self.pending:
            self._land(p, pending.wait())
        self.pending = []
        for p in range(self.fragments):
            self._send_blocking(p)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "at_send": {p: v.clone() for p, v in self.at_send.items()}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.at_send = {int(p): v.to(torch.float32).clone() for p, v in state.get("at_send", {}).items()}


def overlap_steps(schedule: Schedule) -> int:
    """The inner steps each exchange of `schedule` overlaps with: a fragment schedule's tau, 0 for any other."""
    return schedule.tau if isinstance(schedule, Fragments) else 0


class Rounds(Fragments):
    """Plain DiLoCo rounds: every H steps the whole model's delta is averaged, blocking, and the outer step taken."""

    def __init__(self):
        super().__init__(fragments=1, tau=0)
