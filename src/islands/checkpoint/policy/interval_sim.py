"""Failure simulator for interval policies (ckpt-interval): expected lost work and overhead.

Failures arrive as a Poisson process at rate devices / per-device MTBF (LIT-222). The job must do
`hours` of useful work. Each checkpoint stalls training `stall_s`; it becomes durable `persist_s` later
(asynchronous persist). A failure loses everything since the last durable checkpoint and costs
`restart_s`. Adaptive policies are told about uptime and failures as they happen and re-decided after
each checkpoint and restart.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from islands.checkpoint.policy.interval import DAY_S, DEFAULT_DEVICE_MTBF_DAYS


@dataclass
class SimulationResult:
    devices: int
    useful_s: float
    wall_s: float
    failures: int
    checkpoints: int
    lost_work_s: float
    overhead_s: float  # checkpoint stalls
    restart_s: float
    mean_interval_steps: float

    @property
    def waste_fraction(self) -> float:
        return (self.wall_s - self.useful_s) / self.wall_s


def _interval_steps(policy) -> int:
    steps = policy if isinstance(policy, int) else policy.decide().steps
    if steps < 1:
        raise ValueError(f"interval must be >= 1 step, got {steps}")
    return steps


def simulate_failures(
    policy,
    devices: int,
    hours: float,
    rng: random.Random,
    *,
    iter_s: float = 1.0,
    stall_s: float = 1.0,
    persist_s: float = 0.0,
    restart_s: float = 0.0,
    per_device_mtbf_s: float = DEFAULT_DEVICE_MTBF_DAYS * DAY_S,
    max_wall_factor: float = 1000.0,
) -> SimulationResult:
    """Run one simulated job. `policy`: an int (fixed interval in steps) or anything with `.decide()`."""
    if devices < 1 or hours <= 0 or iter_s <= 0:
        raise ValueError(f"need devices >= 1, hours > 0, iter_s > 0; got {devices}, {hours}, {iter_s}")
    rate = devices / per_device_mtbf_s
    work = hours * 3600.0
    t, progress, durable = 0.0, 0.0, 0.0
    pending: tuple[float, float] | None = None  # (progress it saves, time it becomes durable)
    next_fail = rng.expovariate(rate)
    result = SimulationResult(devices, work, 0.0, 0, 0, 0.0, 0.0, 0.0, 0.0)
    decisions = []
    observe = getattr(policy, "observe_uptime", None)
    while progress < work - 1e-9:
        if t > max_wall_factor * work:
            raise RuntimeError(
                f"simulated job made no headway: {t / 3600:.1f} h of wall time for {hours} h of work "
                f"at {devices} devices (interval too long for the failure rate?)"
            )
        steps = _interval_steps(policy)
        decisions.append(steps)
        segment = min(steps * iter_s, work - progress)
        # The previous persist must finish before the next snapshot (one in flight, AsyncCheckpointer
        # when_busy="wait"): any remaining persist time is added to this checkpoint's stall.
        wait = max(0.0, pending[1] - (t + segment)) if pending else 0.0
        end = t + segment + wait + stall_s
        if next_fail < end:
            if pending and pending[1] <= next_fail:
                durable = pending[0]
            pending = None
            result.lost_work_s += progress - durable + min(next_fail - t, segment)
            result.overhead_s += max(0.0, next_fail - t - segment)
            result.failures += 1
            if observe:
                observe(next_fail - t)
            if hasattr(policy, "observe_failure"):
                policy.observe_failure()
            progress, t = durable, next_fail + restart_s
            result.restart_s += restart_s
            next_fail = t + rng.expovariate(rate)
            continue
        if pending:
            durable = pending[0]
        if observe:
            observe(end - t)
        progress += segment
        t = end
        result.overhead_s += wait + stall_s
        result.checkpoints += 1
        pending = (progress, t + persist_s)
    result.wall_s = t
    result.mean_interval_steps = sum(decisions) / len(decisions)
    return result
