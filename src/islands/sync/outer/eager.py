"""DiLoCo with the outer exchange of a round overlapping every inner step of the next: the schedule part
`Overlapped(mode="delayed"|"eager", fragments=F)` (the spec's `overlap=delayed|eager`).

Each fragment p (all parameters when fragments=1) has a boundary every H steps (at offsets[p] + k*H). At a boundary:
    mean_prev = the averaged delta started at the previous boundary (it ran during the H steps since)
    global    = outer_step(global, mean_prev)             every rank: the same bits (one round late)
    fresh     = start - local                              this island's work since the previous boundary
    start the exchange of fresh on the background thread  (ledger: its bytes once, when it runs)
    local     = delayed: global - fresh                    own round kept at full weight, the others' one round late
                eager:   global + share(fresh / M)         own fresh delta, weighted 1/M, stands in for the
                                                           unknown average; share(d) = outer_step(global, d) -
                                                           outer_step(global, 0) on scratch copies, the outer
                                                           optimizer's state untouched (-lr*d without momentum)
    start     = local
The correction of the stand-in is the next boundary: the true average of the round replaces it (global is stepped
with mean_prev, and the local model is rebuilt from global, discarding the stand-in). With the default outer step
(plain SGD, no momentum) the eager local model is therefore
    global_0 - lr * (sum of every landed average + own fresh delta / M),
the own-fresh-plus-others'-stale mix of LIT-906 (Kale et al. 2025, eager updates), and the delayed one is the
one-round-late outer step of LIT-907 (PCCL's async DiLoCo) with the island's own work kept. `delay` (rounds, 0 or 1;
1 unless a test sets it) = 0 lands each exchange in the boundary that started it: bitwise plain DiLoCo.

finish: land what is in flight, rebase each local fragment onto the new global (local = global + work since the last
boundary, the stand-in dropped), then DiLoCo's blocking final sync of the fragments with work since. The last round's
exchange has no inner steps left to hide behind, so finish is where an overlapped run blocks: one exchange (plus
however far the other islands are behind); with a compressor (topkq) that exchange is a few kB.

Floating buffers (BatchNorm statistics): once per cycle their average starts behind the exchanges in flight and lands
in the global model at the next cycle's end, one cycle late like the global parameters; waiting for it there instead
would wait for every fragment still in flight (F > 1). The islands keep their own statistics until finish.
State: the in-flight results (DiLoCo's `inflight`, waited on at save), `start_at` per fragment and the buffers'
average in flight. Measured: docs/outer-strategies.md and the `utilisation` bench.
"""

from __future__ import annotations

import torch

from islands.sync.outer.base import BUFFER_KIND
from islands.sync.outer.exchange import Pending
from islands.sync.outer.flat import FlatView
from islands.sync.outer.rounds import Schedule, ScheduleHost

OVERLAPS = ("none", "delayed", "eager")


class Overlapped(Schedule):
    """DiLoCo's overlapped rounds: `mode` delayed | eager (module docstring); `fragments` F as in Fragments, each
    fragment's exchange running during the next H steps. `delay` (rounds, 0 or 1) is 1 except in tests."""

    modes: tuple[str, ...] = ("delayed", "eager")
    delay: int = 1  # rounds an exchange is in flight; 0 only in tests (the bitwise-plain check)

    def __init__(self, mode: str = "eager", fragments: int = 1):
        super().__init__(fragments)
        if mode not in self.modes:
            raise ValueError(f"overlap must be one of {', '.join(OVERLAPS)}; got {mode!r}")
        self.overlap = mode
        self.start_at: dict[int, torch.Tensor] = {}  # fragment -> the local fragment at its last boundary
        self.buffers_inflight: Pending | None = None  # the floating buffers' average started at the last cycle end

    def options(self) -> dict:
        return {**super().options(), "overlap": self.overlap}

    def elastic_refusal(self) -> str | None:
        if self.overlap != "none":
            # (tau > 0 and fragments are supported: runtime/elastic.py) here a joiner would need the holder's
            # per-fragment start points and buffer average rebased onto its own start, and eager's stand-in
            # step reads the island count on the training thread while an exchange may be failing over
            return (
                f"overlap={self.overlap} is not supported in an elastic job yet; use overlap=none (tau > 0 and "
                "fragments > 1 are)"
            )
        return None

    def bind(self, d: ScheduleHost, world) -> None:
        super().bind(d, world)
        self.start_at = {}
        self.buffers_inflight = None

    def _start_of(self, p: int) -> torch.Tensor:
        lo, hi = self.bounds[p]
        # before the first boundary (and after a final sync) the local fragment started from the global one
        return self.start_at[p] if p in self.start_at else self.d.global_flat[lo:hi]

    def after_step(self, done: int) -> None:
        starting = self.starting(done)
        if not starting:
            return
        for p in starting:  # the exchanges started at these fragments' previous boundaries land first
            for entry in [e for e in self.pending if e[0] == p]:
                self.pending.remove(entry)
                self.d.outer_step(p, entry[2].wait())
        plain = self.delay == 0 and self.fragments == 1
        if not plain and starting[-1] == self.fragments - 1:
            self._cycle_buffers()  # once per cycle, before this boundary's exchange starts
        for p in starting:
            self._boundary(p, done)
        if plain:
            self.d.synced()  # nothing in flight: a full synchronisation, as plain DiLoCo's round

    def _boundary(self, p: int, done: int) -> None:
        d, (lo, hi) = self.d, self.bounds[p]
        fresh = self._start_of(p) - d.local.read(lo, hi)
        self.sends[p] += 1
        pending = d.exchange.start(d.comm, fresh, name=f"fragment{p}")
        if self.delay == 0:  # lands at once: the local fragment restarts from the new global one (plain DiLoCo)
            d.outer_step(p, pending.wait())
            d.adopt_global(lo, hi)
            self.start_at[p] = d.global_flat[lo:hi].clone()
            return
        self.pending.append((p, done + self.delay * self.inner_steps, pending))
        self._stand_in(p, fresh)

    def _stand_in(self, p: int, fresh: torch.Tensor) -> None:
        """The local fragment until the exchange lands: eager's share of the own fresh delta, or delayed's own round."""
        d, (lo, hi) = self.d, self.bounds[p]
        local = self._trial(p, fresh / d.comm.size) if self.overlap == "eager" else d.global_flat[lo:hi] - fresh
        d.local.write(local, lo)
        self.start_at[p] = local.clone()

    def _trial(self, p: int, delta: torch.Tensor) -> torch.Tensor:
        """global[p] moved by the share of the outer step that `delta` makes: outer_step(global, delta) minus
        outer_step(global, 0), both on scratch copies, the outer optimizer's state left as it was. Without momentum
        it is global - lr * delta; with momentum the carried momentum cancels (already applied at the landing)."""
        d, (lo, hi) = self.d, self.bounds[p]
        saved = d.outer.state_dict()
        moved = []
        for step in (delta, torch.zeros_like(delta)):
            scratch = d.global_flat.clone()
            d.outer.step(scratch, step, lo, hi, d.outer_lr_factor())
            d.outer.load_state_dict(saved)
            moved.append(scratch[lo:hi])
        return d.global_flat[lo:hi] + (moved[0] - moved[1])

    def _cycle_buffers(self) -> None:
        """The buffer policy once per cycle without waiting: the floating buffers' average starts behind the
        exchanges in flight and lands at the next cycle's end (or in finish) in the global model, one cycle late
        like the parameters there; the islands keep their own running statistics until finish's blocking
        synchronisation adopts the average. Blocking here instead (synced_buffers) would wait for every fragment
        exchange in flight once per cycle when F > 1, for any model with floating buffers (BatchNorm)."""
        d = self.d
        floating = [b for b in d.local_buffers if b.is_floating_point()]
        if self.delay == 0 or not floating or d.buffer_policy != "average" or d.comm.size == 1:
            d.synced_buffers()  # nothing in flight (delay 0) or nothing to send: the blocking policy costs nothing
            return
        self._land_buffers()
        flat, comm = FlatView(floating).read(), d.comm

        def average() -> torch.Tensor:
            comm.all_reduce(flat, kind=BUFFER_KIND)
            return flat

        self.buffers_inflight = d.exchange.submit(average)

    def _land_buffers(self) -> None:
        if self.buffers_inflight is None:
            return
        d = self.d
        mean = self.buffers_inflight.wait().div(d.comm.size)
        self.buffers_inflight = None
        FlatView([b for b in d.global_buffers if b.is_floating_point()]).write(mean)
        with torch.no_grad():  # integer buffers (num_batches_tracked): the island's own, as in synced_buffers
            for own, glob in zip(d.local_buffers, d.global_buffers):
                if not own.is_floating_point():
                    glob.copy_(own)

    def _rebase(self) -> None:
        """Land what is in flight; each local fragment becomes global + the work since its last boundary."""
        d = self.d
        self._land_buffers()
        for p, _, pending in self.pending:
            d.outer_step(p, pending.wait())
        self.pending = []
        for p in range(self.fragments):
            lo, hi = self.bounds[p]
            work = d.local.read(lo, hi) - self._start_of(p)
            d.local.write(d.global_flat[lo:hi] + work, lo)
        self.start_at = {}

    def final_sync(self) -> None:
        """Land what is in flight, rebase, then sync every fragment with work since its last boundary, blocking."""
        self._rebase()
        skip = set(self.starting(self.d.clock))  # a boundary was the last step: no work since, nothing to send
        for p in range(self.fragments):
            if p not in skip:
                self._send_blocking(p)

    def state_dict(self) -> dict:
        state = {**super().state_dict(), "start_at": {p: v.clone() for p, v in self.start_at.items()}}
        if self.buffers_inflight is not None:  # waited on here, as the parameters' exchanges are at save
            state["buffers_inflight"] = self.buffers_inflight.wait().clone()
            self.buffers_inflight = Pending(value=state["buffers_inflight"])
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.start_at = {int(p): v.to(torch.float32).clone() for p, v in state.get("start_at", {}).items()}
        buffers = state.get("buffers_inflight")
        self.buffers_inflight = Pending(value=buffers.to(torch.float32).clone()) if buffers is not None else None
