"""DiLoCo rounds for islands of different speeds, the schedule part `Adaptive(mode="speed"|"deadline", deadline=0,
overlap="none"|"delayed"|"eager")` (the spec's `adapt=speed|deadline`): a slow island no longer sets the pace.

Synchronous DiLoCo gives every island H inner steps per round, so each round lasts as long as the slowest island's H
steps and the faster ones wait at the exchange. Here the islands meet at the same wall time instead, each bringing
what it computed, and the average weights each island's delta by the samples behind it:

    mean = sum_i n_i * delta_i / sum_i n_i          n_i = samples island i stepped on this round

adapt=speed   speed-adaptive local steps (DyLU, LIT-910): every island measures its compute seconds per inner step
              (from on_batch to after_step: forward, backward, optimizer, any slowdown; not the exchange, data
              loading or callbacks). At each exchange the islands all-gather (samples, compute seconds per step,
              steps, wall seconds per step, wall-clock time at the round's end), 40 bytes each (ledger kind
              "outer_speed"), and plan the next round:
              the fastest island takes H steps, island i H_i = clamp(round(H * t_fast / t_i), 1, H), t the median
              compute seconds per step of the island's last round, so every island's round lasts about the
              fastest island's H steps.
adapt=deadline  a wall-clock budget per round: `deadline` seconds, or (deadline=0) H times the fastest island's wall
              seconds per step in its last round (the exchange's wait excluded). Each island takes inner steps
              until the next one would end more than half a step past the budget (counted from its first step
              after the last exchange), at most H, then exchanges. It follows a speed change within the round;
              adapt=speed follows it one round late.

The first round takes H steps on every island (nothing is measured yet), unless a deadline in seconds is given.
The contribution sent is delta_i * (M n_i / sum n) over the usual exchange (plain all-reduce or a compressor, error
feedback included), whose mean of M contributions is the weighted mean above; with equal samples the scale is
skipped, so the rounds are plain DiLoCo's bit for bit. A robust aggregator is refused (it would need the weights
inside its rule).

The step counter stays the fastest island's: a round spans H counted steps on every island, and an island that
stopped after H_i < H skips the counter to the round's end (`next_step`, honoured by islands' Trainer), so the lr
schedule, evaluation, checkpoints and the run's length (train.steps) stay aligned across islands. The last round
of a run whose length is not a multiple of H ends at the run's end on the fastest island; an island that planned
more steps than fit sends its delta when it gets there, the others waiting for it.

Islands of several workers agree inside the island before any cross-island step: the seconds per step are the
island's slowest worker's (an all-reduce MAX on the island's group at each exchange), and under adapt=deadline the
stop decision is one MAX per step on the island's group (ledger kind "island_deadline"), so DDP inside the island
never sees its workers take different steps.

With overlap=eager|delayed (eager.py) a round's exchange runs behind the next round's inner steps: at a round's
end the island lands the exchange started at the previous one (the outer step, and the plan from the speeds it
carried), then starts its own on the exchange thread: the 40-byte speed all-gather and the weighted delta, one
after the other, so no island waits for another at the boundary. The stand-in is eager's (own fresh delta at
weight 1/M, or kept at full weight under delayed), replaced by the true weighted mean a round later. Plans and
deadlines therefore follow the speeds one round later than without overlap (the first two rounds take H steps
unless a deadline in seconds is given). This is what removes the skew of islands that should be equally fast
but are not (shared cores, a noisy neighbour): each round ends at the same wall time on every island, so the
exchange in flight is complete when the next boundary comes. Islands that drifted apart before the budget was
known (the first two rounds, or a burst of load) would stay apart, and the drift would be paid at the end, in
finish, by the island that arrives first; so under adapt=deadline each island also catches up: the speeds carry
each island's wall-clock time at its round's end, and when round k's speeds land (at round k+1's end) an island
that ended round k behind the earliest cuts round k+2 by what round k+1's own cut has not made up yet,

    cut_i(k+2) = clamp(lag_i(k) - cut_i(k+1), 0, B / 2)     budget_i = B - cut_i     B: the rounds' budget;
                                                            lag_i(k): how far (wall clock) island i ended round
                                                            k behind the earliest island

(cut_i(k+1) is B - round k+1's budget_i) so only lag relative to the other islands is cut: rounds that all run
longer than B (a landing, a slow first step) add no cut, and the earliest island never cuts. A round is never
cut below half a budget (machines' clocks that disagree, NTP's milliseconds aside, cost at most that). finish
lands the exchange in flight, rebases the local model onto the new global one and sends the last partial round,
if this island has one, blocking.

Time-based rounds are not bitwise reproducible across runs: H_i and the deadline follow measured times. Everything
the rounds carry is state, saved and restored exactly (the round's steps, samples and step times so far, the
time it has run, the plan, the budget, the measured rates and wall times, the per-round history, the exchange in
flight with the speeds it carries), so a resumed run continues the same round; only what later clocks read
differs. Not supported yet: elastic membership, fragments > 1, tau, sync_inner_state.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from islands.aggregate.coordinate import Mean
from islands.data.batches import size as batch_size_of
from islands.sync.outer.eager import Overlapped
from islands.sync.outer.exchange import Pending
from islands.sync.outer.rounds import ScheduleHost

ADAPTS = ("none", "speed", "deadline")
SPEED_KIND = "outer_speed"  # the per-round (samples, seconds per step, steps, wall per step, end) all-gather
DEADLINE_KIND = "island_deadline"  # the per-step stop flag inside a multi-worker island (not cross-island bytes)


class RoundMeter:
    """This island's round so far: steps, samples, each step's compute seconds, the round's wall seconds.
    `timer` (per step) and `wallclock` (the rounds' end, comparable across machines) are replaced by tests."""

    def __init__(self):
        self.timer = time.perf_counter
        self.wallclock = time.time
        self.steps = 0  # inner steps this island took this round
        self.samples = 0  # samples those steps stepped on (steps when the batch size is unknown)
        self.times: list[float] = []  # each step's compute seconds (on_batch to after_step)
        self.elapsed = 0.0  # wall seconds of the round so far, kept at save
        self.began: float | None = None  # timer at this step's on_batch
        self.round_start: float | None = None  # timer when the round started (its first on_batch)
        self.last_batch = 0

    def on_batch(self, batch) -> None:
        self.began = self.timer()
        if self.round_start is None:  # a round's clock starts with its first step (or again after a resume)
            self.round_start = self.began - self.elapsed
        try:
            self.last_batch = int(batch_size_of(batch))
        except (TypeError, ValueError):  # a batch structure without a size: weigh by steps instead
            self.last_batch = 0

    def after_step(self) -> None:
        now = self.timer()
        began = self.began if self.began is not None else now
        self.began = None
        self.steps += 1
        self.samples += self.last_batch or 1
        self.times.append(now - began)
        if self.round_start is None:
            self.round_start = began
        self.elapsed = now - self.round_start

    def reset(self) -> None:
        self.steps, self.samples, self.times, self.elapsed = 0, 0, [], 0.0
        self.round_start = None


class Adaptive(Overlapped):
    """DiLoCo's rounds for islands of different speeds (module docstring). `mode`: speed (the fastest island takes
    H steps, the others in proportion to their measured speed) | deadline (each island steps until a wall-clock
    budget per round runs out); `deadline`: mode=deadline's budget in seconds (0: the fastest island's measured
    time for H steps); `overlap`: none | delayed | eager, each round's exchange behind the next round's steps."""

    modes = ("none", "delayed", "eager")  # of `overlap` here

    def __init__(self, mode: str = "speed", deadline: float = 0.0, overlap: str = "none"):
        super().__init__(overlap, fragments=1)
        if mode not in ADAPTS[1:]:
            raise ValueError(f"adapt must be one of {', '.join(ADAPTS)}; got {mode!r}")
        if not (deadline >= 0 and math.isfinite(deadline)):
            raise ValueError(
                f"deadline must be >= 0 seconds (0: the fastest island's time for H steps); got {deadline}"
            )
        if deadline > 0 and mode != "deadline":
            raise ValueError(f"deadline={deadline} applies to adapt=deadline only; got adapt={mode!r}")
        self.adapt, self.deadline = mode, float(deadline)
        self.meter = RoundMeter()
        self.island_comm = None  # agreement inside a multi-worker island (bind)
        self.round_base = 0  # the counted step this round started at (a multiple of H)
        self.plan = 0  # adapt=speed: this island's steps this round (bind: H)
        self.budget = self.deadline  # adapt=deadline: the rounds' budget in seconds (0: none measured yet, H steps)
        self.round_budget = self.deadline  # this island's budget for the round in progress (overlap: catching up)
        self.rates: list[
            float
        ] = []  # every island's compute seconds per step at the last exchange, in cross-rank order
        self.walls: list[float] = []  # every island's wall seconds per step in its last round
        self.history: list[list[int]] = []  # steps each island took, per round (reports and tests)
        self.skip_to = 0  # the counted step the loop continues from after this island's exchange
        # overlap: (every island's speeds, weighted mean) in flight
        self.round_inflight: Pending[tuple[torch.Tensor, torch.Tensor]] | None = None

    def options(self) -> dict:
        return {**super().options(), "adapt": self.adapt}

    def refusal(self, exchange, sync_inner_state: bool) -> str | None:
        """Adaptive rounds weigh each island's delta by its samples: no robust aggregator, no sync_inner_state."""
        if sync_inner_state:  # (the base's message names plain rounds; this one says what adaptive rounds allow)
            return (
                f"adapt={self.adapt} runs whole-model DiLoCo rounds (fragments=1, tau=0, sync_inner_state=0; "
                f"overlap=eager|delayed is fine); drop sync_inner_state=1"
            )
        if exchange.aggregator is not None and not isinstance(exchange.aggregator, Mean):
            return (
                f"adapt={self.adapt} weighs each island's delta by its samples; a robust aggregator has no such "
                "weights: drop aggregator= or use adapt=none"
            )
        return None

    def bind(self, d: ScheduleHost, world) -> None:
        super().bind(d, world)
        if d.membership is not None:
            raise ValueError(
                f"adapt={self.adapt} is not supported in an elastic job yet (a joiner would enter with "
                "a round planned for other islands); use adapt=none"
            )
        distributed = world.distributed and world.workers_per_island > 1
        self.island_comm = world.comm("local") if distributed else None
        self.meter = RoundMeter()
        self.round_base = 0
        self.plan = self.inner_steps
        self.budget = self.round_budget = self.deadline
        self.rates, self.walls, self.history = [], [], []
        self.skip_to = 0
        self.round_inflight = None

    # ---- the hooks --------------------------------------------------------------------------------
    def on_batch(self, batch) -> None:
        self.meter.on_batch(batch)

    def after_step(self, done: int) -> None:
        self.meter.after_step()
        if self._round_over(done):
            if self.overlap == "none":
                self._exchange()
                self.d.synced()
            else:
                self._boundary_overlapped()
            self.skip_to = self.round_base + self.inner_steps
            self.round_base = self.skip_to

    def _round_over(self, done: int) -> bool:
        if done - self.round_base >= self.inner_steps:  # the counted round is over (the fastest island's H)
            return True
        if self.adapt == "speed":
            stop = self.meter.steps >= self.plan
        else:
            per_step = statistics.median(self.meter.times)
            # stop where the next step would end more than half a step past the budget
            stop = self.round_budget > 0 and self.meter.elapsed + 0.5 * per_step >= self.round_budget
            if self.island_comm is not None:  # every worker of the island stops at the same step
                flag = torch.tensor([1.0 if stop else 0.0])
                stop = bool(
                    self.island_comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, kind=DEADLINE_KIND).item() > 0
                )
        return stop

    def next_step(self, done: int) -> int:
        """The counted step the loop continues from after `done` steps: the round's end once this island has sent."""
        return max(done, self.skip_to)

    def has_pending(self) -> bool:
        return super().has_pending() or self.round_inflight is not None

    # ---- the exchange -----------------------------------------------------------------------------
    def _exchange(self) -> None:
        """Collective: the weighted mean of this round's deltas, the outer step, and the next round's plan."""
        d, (lo, hi) = self.d, self.bounds[0]
        gathered, mean = self._weighted_mean(self._my_speeds(), d.global_flat[lo:hi] - d.local.read(lo, hi))
        self.sends[0] += 1
        self._adopt(0, mean)
        self._learn(gathered)
        self.meter.reset()

    def _my_speeds(self) -> torch.Tensor:
        """(samples, compute s/step, steps, wall s/step, wall-clock end) of this island's round, agreed inside the
        island (its slowest worker's rates, its latest worker's end)."""
        m = self.meter
        # the median: a round's first step (lazy allocations) or a burst of other load barely moves it
        per_step = statistics.median(m.times) if m.times else float("nan")
        # and the round's wall seconds per step (data loading and the loop's own work too): what a deadline spends
        wall = m.elapsed / m.steps if m.steps else float("nan")
        end = float(m.wallclock())
        if self.island_comm is not None:  # the island is as fast as its slowest worker
            t = torch.tensor([per_step, wall, end], dtype=torch.float64)
            per_step, wall, end = self.island_comm.all_reduce(
                t, op=torch.distributed.ReduceOp.MAX, kind=DEADLINE_KIND
            ).tolist()
        return torch.tensor([float(m.samples), per_step, float(m.steps), wall, end], dtype=torch.float64)

    def _weighted_mean(self, mine: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Collective (on either thread): every island's speeds, then the samples-weighted mean of the deltas."""
        comm = self.d.comm
        gathered = torch.stack(comm.all_gather(mine, kind=SPEED_KIND)) if comm.size > 1 else mine[None]
        samples = gathered[:, 0]
        if not bool((samples == samples[0]).all()):
            delta = delta.mul_(weight_scale(samples.tolist(), comm.rank))
        return gathered, self.d.exchange.mean(comm, delta, name="fragment0")

    def _learn(self, gathered: torch.Tensor) -> None:
        """A round's speeds, landed: the history and the next round's plan or budget."""
        cut_before = self.budget - self.round_budget  # what the round that just ended made up of the lag
        self.history.append([int(s) for s in gathered[:, 2].tolist()])
        self.rates = [float(r) for r in gathered[:, 1].tolist()]
        self.walls = [float(r) for r in gathered[:, 3].tolist()]
        self._plan(self.rates, self.walls)
        if self.adapt == "deadline" and self.overlap != "none" and self.delay > 0 and self.budget > 0:
            lag = float(gathered[self.d.comm.rank, 4] - gathered[:, 4].min())
            self.round_budget = catch_up(self.budget, lag, cut_before)

    # ---- overlap=eager|delayed: the exchange behind the next round ----------------------------------
    def _land_round(self) -> None:
        """The exchange started at the last round's end: the outer step on its weighted mean, its speeds learnt."""
        if self.round_inflight is None:
            return
        gathered, mean = self.round_inflight.wait()
        self.round_inflight = None
        self.d.outer_step(0, mean)
        self._learn(gathered)

    def _boundary_overlapped(self) -> None:
        """A round's end under overlap: land the previous round, start this one's exchange, step on a stand-in."""
        d, (lo, hi) = self.d, self.bounds[0]
        self._land_round()
        if self.delay > 0:
            self._cycle_buffers()
        mine = self._my_speeds()
        fresh = self._start_of(0) - d.local.read(lo, hi)
        self.sends[0] += 1
        self.round_inflight = d.exchange.submit(lambda: self._weighted_mean(mine, fresh.clone()))
        self.meter.reset()
        if self.delay == 0:  # lands at once (tests): plain adaptive rounds, bit for bit
            self._land_round()
            d.adopt_global(lo, hi)
            self.start_at[0] = d.global_flat[lo:hi].clone()
            d.synced()
            return
        self._stand_in(0, fresh)

    def final_sync(self) -> None:
        """This island's partial round, weighted like every other (under overlap: land what is in flight, rebase
        onto the new global model, then send the partial round, if any)."""
        if self.overlap == "none":
            self._exchange()
            return
        self._land_round()
        self._rebase()  # the floating buffers' average lands; local = global + work since the last boundary
        if self.meter.steps > 0:  # every worker of an island agrees on its steps; islands pair this with a boundary
            self._exchange()

    def report(self) -> dict:
        return {"adapt": self.adapt, "steps_per_round": self.history, "last_rates": self.rates}

    def _plan(self, rates: list[float], walls: list[float]) -> None:
        def fastest(values):
            measured = [r for r in values if r > 0 and math.isfinite(r)]
            return min(measured) if measured else None  # None: no island stepped; keep the plan and budget

        if self.adapt == "speed" and fastest(rates) is not None:
            self.plan = plan_steps(self.inner_steps, fastest(rates), rates[self.d.comm.rank])
        elif self.adapt == "deadline" and fastest(walls) is not None:
            # the fastest island's wall time for H steps (it fits H: it stops half a step before the budget)
            self.budget = self.deadline if self.deadline > 0 else self.inner_steps * fastest(walls)
            self.round_budget = self.budget

    # ---- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        m = self.meter
        adapt = {
            "round_base": self.round_base,
            "round_steps": m.steps,
            "round_samples": m.samples,
            "round_times": list(m.times),
            "round_elapsed": m.elapsed,
            "plan": self.plan,
            "budget": self.budget,
            "round_budget": self.round_budget,
            "rates": list(self.rates),
            "walls": list(self.walls),
            "history": [list(h) for h in self.history],
            "skip_to": self.skip_to,
        }
        if self.round_inflight is not None:
            gathered, mean = self.round_inflight.wait()  # waited on at save (Pending keeps the result for the landing)
            adapt.update(inflight_speeds=gathered.clone(), inflight_mean=mean.clone())
        return {**super().state_dict(), "adapt": adapt}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        a = state.get("adapt")
        if a is None:
            return
        m = self.meter
        self.round_base, m.steps, m.samples = int(a["round_base"]), int(a["round_steps"]), int(a["round_samples"])
        m.times, m.elapsed = [float(t) for t in a["round_times"]], float(a["round_elapsed"])
        self.plan, self.budget = int(a["plan"]), float(a["budget"])
        self.round_budget = float(a.get("round_budget", self.budget))
        self.rates = [float(r) for r in a["rates"]]
        self.walls = [float(r) for r in a["walls"]]
        self.history = [[int(s) for s in h] for h in a["history"]]
        self.skip_to = int(a["skip_to"])
        self.round_inflight = None
        if "inflight_mean" in a:
            self.round_inflight = Pending(
                value=(a["inflight_speeds"].to(torch.float64).clone(), a["inflight_mean"].to(torch.float32).clone())
            )
        m.began = m.round_start = None  # the round's clock restarts from round_elapsed at the next step


def plan_steps(inner_steps: int, fastest: float, mine: float) -> int:
    """DyLU's rule (LIT-910): steps in proportion to speed, the fastest island taking H, every island at least 1."""
    if not mine > 0 or not math.isfinite(mine):
        return inner_steps
    return max(1, min(inner_steps, round(inner_steps * fastest / mine)))


def catch_up(budget: float, lag: float, cut_before: float) -> float:
    """Overlapped deadline rounds: this island's budget for its next round (k+2). Round k's speeds land at the end
    of round k+1; the island ended round k `lag` seconds after the earliest island and has since cut round k+1 by
    `cut_before` seconds, so round k+2 is cut by the rest of the lag: relative to the other islands only, never by
    more than half a budget (clocks that disagree cost at most that), never lengthened."""
    return budget - min(0.5 * budget, max(0.0, lag - cut_before))


def weight_scale(samples: list[float], rank: int) -> float:
    """What this rank's delta is multiplied by so that the plain mean of M contributions is the samples-weighted
    mean: M * n_rank / sum(n). Computed in float64 from the gathered counts, the same on every rank."""
    total = math.fsum(samples)
    if not total > 0:
        raise ValueError(f"weighted outer mean: the islands stepped on {samples} samples this round; need > 0")
    return len(samples) * samples[rank] / total
