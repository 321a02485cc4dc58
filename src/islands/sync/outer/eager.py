"""DiLoCo with the outer exchange of a round overlapping every inner step of the next (`overlap=delayed|eager`).

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
boundary, the stand-in dropped), then DiLoCo's blocking final sync of the fragments with work since. State: the in-flight results (DiLoCo's
`inflight`, waited on at save) and `start_at` per fragment. Measured: docs/outer-strategies.md.
"""

from __future__ import annotations

import torch

OVERLAPS = ("none", "delayed", "eager")


class EagerOverlap:
    """The overlap=delayed|eager rounds of DiLoCo (mixed into it; DiLoCo's attributes are used directly)."""

    overlap: str = "none"
    delay: int = 1  # rounds an exchange is in flight; 0 only in tests (the bitwise-plain check)

    def _overlap_setup(self) -> None:
        if self.overlap != "none" and self.membership is not None:
            raise ValueError(f"overlap={self.overlap} is not supported in an elastic job yet (a member would join "
                             "with a round's exchange in flight); use overlap=none")
        self.start_at: dict[int, torch.Tensor] = {}  # fragment -> the local fragment at its last boundary

    def _start_of(self, p: int) -> torch.Tensor:
        lo, hi = self.bounds[p]
        # before the first boundary (and after a final sync) the local fragment started from the global one
        return self.start_at[p] if p in self.start_at else self.global_flat[lo:hi]

    def _overlap_after_step(self, done: int) -> None:
        starting = self.starting(done)
        if not starting:
            return
        for p in starting:  # the exchanges started at these fragments' previous boundaries land first
            for entry in [e for e in self.pending if e[0] == p]:
                self.pending.remove(entry)
                self._outer_step(p, entry[2].wait())
        plain = self.delay == 0 and self.fragments == 1
        if not plain and starting[-1] == self.fragments - 1:
            # once per cycle, before this boundary's exchange starts (in_order runs behind the exchanges in
            # flight: with F=1 none is; with F>1 the other fragments' may be, and this waits for them)
            self.synced_buffers()
        for p in starting:
            self._boundary(p, done)
        if plain:
            self.synced()  # nothing in flight: a full synchronisation, as plain DiLoCo's round

    def _boundary(self, p: int, done: int) -> None:
        lo, hi = self.bounds[p]
        fresh = self._start_of(p) - self.local.read(lo, hi)
        self.sends[p] += 1
        pending = self.exchange.start(self.comm, fresh, name=f"fragment{p}")
        if self.delay == 0:  # lands at once: the local fragment restarts from the new global one (plain DiLoCo)
            self._outer_step(p, pending.wait())
            self.adopt_global(lo, hi)
            self.start_at[p] = self.global_flat[lo:hi].clone()
            return
        self.pending.append((p, done + self.delay * self.inner_steps, pending))
        if self.overlap == "eager":
            local = self._trial(p, fresh / self.comm.size)
        else:
            local = self.global_flat[lo:hi] - fresh
        self.local.write(local, lo)
        self.start_at[p] = local.clone()

    def _outer_step(self, p: int, mean_delta: torch.Tensor) -> None:
        lo, hi = self.bounds[p]
        self.opt.step(self.global_flat, mean_delta, lo, hi, lr_scale=self.outer_lr_factor())
        self.publish(lo, hi)
        self.rounds += 1

    def _trial(self, p: int, delta: torch.Tensor) -> torch.Tensor:
        """global[p] moved by the share of the outer step that `delta` makes: outer_step(global, delta) minus
        outer_step(global, 0), both on scratch copies, the outer optimizer's state left as it was. Without momentum
        it is global - lr * delta; with momentum the carried momentum cancels (already applied at the landing)."""
        lo, hi = self.bounds[p]
        saved = self.opt.state_dict()
        moved = []
        for d in (delta, torch.zeros_like(delta)):
            scratch = self.global_flat.clone()
            self.opt.step(scratch, d, lo, hi, lr_scale=self.outer_lr_factor())
            self.opt.load_state_dict(saved)
            moved.append(scratch[lo:hi])
        return self.global_flat[lo:hi] + (moved[0] - moved[1])

    def _overlap_final(self) -> None:
        """Land what is in flight; each local fragment becomes global + the work since its last boundary."""
        for p, _, pending in self.pending:
            self._outer_step(p, pending.wait())
        self.pending = []
        for p in range(self.fragments):
            lo, hi = self.bounds[p]
            work = self.local.read(lo, hi) - self._start_of(p)
            self.local.write(self.global_flat[lo:hi] + work, lo)
        self.start_at = {}

    def _overlap_state(self) -> dict:
        return {"start_at": {p: v.clone() for p, v in self.start_at.items()}}

    def _load_overlap_state(self, state: dict) -> None:
        self.start_at = {int(p): v.to(torch.float32).clone() for p, v in state.get("start_at", {}).items()}
