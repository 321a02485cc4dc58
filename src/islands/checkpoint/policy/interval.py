"""How often to checkpoint: an overhead bound from online profiling (SOTA-054) and the failure rate (SOTA-189).

CheckFreqPolicy (LIT-059): profile iteration time, snapshot stall and persist time online (smoothed),
and take the shortest interval whose stall stays under the overhead bound and whose persist finishes
before the next snapshot. Unlike CheckFreq, persist time is measured rather than derived from an assumed
disk speed, and the interval is recomputed from fresh measurements, so it shrinks as well as grows.

YoungDalyInterval: the interval that minimises expected waste, overhead C/T plus lost work T/(2 MTTF),
is T = sqrt(2 C MTTF) (Young 1974; Daly 2006). MTTF falls linearly with job size (LIT-222):
MTTF = per-device MTBF / devices, default 3,748.25 days per device. Observed failures update the
per-device figure (gamma-exponential: the default counts as `prior_failures` pseudo-observations).

CombinedIntervalPolicy: minimise waste subject to the overhead bound; waste is convex in T, so the
answer is max(overhead floor, Young/Daly optimum), and `reason` says which one binds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFAULT_OVERHEAD_BOUND = 0.035  # issue #6: keep checkpoint overhead under 3.5% of training time
DEFAULT_DEVICE_MTBF_DAYS = 3748.25  # LIT-222: per-GPU failure rate fitted on real job interruptions
DAY_S = 86400.0


@dataclass(frozen=True)
class IntervalDecision:
    steps: int  # checkpoint every this many steps
    seconds: float  # the same in wall time at the profiled iteration time
    binding: str  # which constraint set it: "overhead", "persist", "failures", "min", "max"
    reason: str  # one human-readable sentence; the run record stores it
    details: dict = field(default_factory=dict)


def _fmt_s(seconds: float) -> str:
    if seconds >= 2 * DAY_S:
        return f"{seconds / DAY_S:.2f} d"
    if seconds >= 7200:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.3g} s"


def young_daly_seconds(checkpoint_cost_s: float, mttf_s: float) -> float:
    """sqrt(2 * C * MTTF): the waste-minimising interval in seconds."""
    if checkpoint_cost_s < 0 or mttf_s <= 0:
        raise ValueError(f"need checkpoint_cost_s >= 0 and mttf_s > 0, got {checkpoint_cost_s}, {mttf_s}")
    return math.sqrt(2.0 * checkpoint_cost_s * mttf_s)


def expected_waste_fraction(interval_s: float, checkpoint_cost_s: float, mttf_s: float) -> float:
    """First-order waste per unit of useful time: C/T overhead + T/(2 MTTF) lost work (SOTA-189)."""
    if interval_s <= 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s}")
    return checkpoint_cost_s / interval_s + interval_s / (2.0 * mttf_s)


def checkfreq_interval(
    iter_s: float,
    stall_s: float,
    persist_s: float,
    bound: float = DEFAULT_OVERHEAD_BOUND,
    *,
    min_steps: int = 1,
    max_steps: int = 1_000_000,
) -> IntervalDecision:
    """Shortest interval (steps) with stall/(steps*iter) <= bound and the persist done before the next save."""
    if iter_s <= 0:
        raise ValueError(f"iter_s must be > 0 (seconds per training step), got {iter_s}")
    if stall_s < 0 or persist_s < 0:
        raise ValueError(f"stall_s and persist_s must be >= 0, got {stall_s}, {persist_s}")
    if not 0 < bound < 1:
        raise ValueError(f"overhead bound must be a fraction in (0, 1), e.g. 0.035; got {bound}")
    floors = {
        "overhead": math.ceil(stall_s / (bound * iter_s) - 1e-9),
        "persist": math.ceil(persist_s / iter_s - 1e-9),
        "min": min_steps,
    }
    binding = max(floors, key=lambda k: (floors[k], k == "overhead"))
    steps = floors[binding]
    if steps > max_steps:
        steps, binding = max_steps, "max"
    overhead = stall_s / (steps * iter_s)
    reason = (
        f"every {steps} steps ({_fmt_s(steps * iter_s)}): {binding} binds; stall {stall_s:.3g} s per "
        f"checkpoint over {iter_s:.3g} s/step gives {overhead:.2%} overhead (bound {bound:.1%}), "
        f"persist {persist_s:.3g} s"
    )
    return IntervalDecision(
        steps,
        steps * iter_s,
        binding,
        reason,
        {
            "iter_s": iter_s,
            "stall_s": stall_s,
            "persist_s": persist_s,
            "bound": bound,
            "overhead": overhead,
            "floors": floors,
        },
    )


class _Ewma:
    def __init__(self, alpha: float):
        self.alpha = alpha
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value


class CheckFreqPolicy:
    """Online-profiled interval under an overhead bound (SOTA-054). Feed it measurements, ask `decide()`."""

    def __init__(
        self,
        overhead_bound: float = DEFAULT_OVERHEAD_BOUND,
        *,
        smoothing: float = 0.3,
        min_steps: int = 1,
        max_steps: int = 1_000_000,
        initial_steps: int = 100,
    ):
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.overhead_bound, self.min_steps, self.max_steps = overhead_bound, min_steps, max_steps
        self.initial_steps = initial_steps
        self._iter, self._stall, self._persist = _Ewma(smoothing), _Ewma(smoothing), _Ewma(smoothing)

    def observe_iteration(self, seconds: float) -> None:
        self._iter.add(float(seconds))

    def observe_checkpoint(self, stall_s: float, persist_s: float) -> None:
        self._stall.add(float(stall_s))
        self._persist.add(float(persist_s))

    @property
    def iter_s(self) -> float | None:
        return self._iter.value

    @property
    def stall_s(self) -> float | None:
        return self._stall.value

    def decide(self) -> IntervalDecision:
        # (stall and persist are observed together)
        if self._iter.value is None or self._stall.value is None or self._persist.value is None:
            return IntervalDecision(
                self.initial_steps,
                float("nan"),
                "min",
                f"every {self.initial_steps} steps: no checkpoint profiled yet (initial guess)",
            )
        return checkfreq_interval(
            self._iter.value,
            self._stall.value,
            self._persist.value,
            self.overhead_bound,
            min_steps=self.min_steps,
            max_steps=self.max_steps,
        )

    def state_dict(self) -> dict:
        return {"iter_s": self._iter.value, "stall_s": self._stall.value, "persist_s": self._persist.value}

    def load_state_dict(self, state: dict) -> None:
        self._iter.value, self._stall.value, self._persist.value = state["iter_s"], state["stall_s"], state["persist_s"]


class YoungDalyInterval:
    """Failure-aware interval: sqrt(2 * checkpoint cost * MTTF), MTTF = per-device MTBF / devices (SOTA-189)."""

    def __init__(
        self,
        devices: int,
        *,
        per_device_mtbf_s: float = DEFAULT_DEVICE_MTBF_DAYS * DAY_S,
        checkpoint_cost_s: float | None = None,
        iter_s: float | None = None,
        prior_failures: float = 1.0,
    ):
        if not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices must be a positive int, got {devices!r}")
        if per_device_mtbf_s <= 0 or prior_failures <= 0:
            raise ValueError("per_device_mtbf_s and prior_failures must be > 0")
        self.devices, self.checkpoint_cost_s, self.iter_s = devices, checkpoint_cost_s, iter_s
        self.prior_mtbf_s, self.prior_failures = per_device_mtbf_s, prior_failures
        self.failures, self.device_seconds = 0, 0.0

    def observe_uptime(self, wall_seconds: float) -> None:
        """The job ran `wall_seconds` on all its devices (adds device-seconds of exposure)."""
        self.device_seconds += wall_seconds * self.devices

    def observe_failure(self, count: int = 1) -> None:
        self.failures += count

    def observe_checkpoint(self, stall_s: float, persist_s: float = 0.0) -> None:
        self.checkpoint_cost_s = stall_s

    def observe_iteration(self, seconds: float) -> None:
        self.iter_s = seconds

    @property
    def per_device_mtbf_s(self) -> float:
        """Posterior mean: (prior pseudo-exposure + observed exposure) / (prior pseudo-failures + failures)."""
        exposure = self.prior_failures * self.prior_mtbf_s + self.device_seconds
        return exposure / (self.prior_failures + self.failures)

    @property
    def mttf_s(self) -> float:
        return self.per_device_mtbf_s / self.devices

    def decide(self) -> IntervalDecision:
        if self.checkpoint_cost_s is None or self.iter_s is None:
            raise ValueError("YoungDalyInterval needs checkpoint_cost_s and iter_s (pass them or observe them first)")
        seconds = young_daly_seconds(self.checkpoint_cost_s, self.mttf_s)
        steps = max(1, round(seconds / self.iter_s))
        reason = (
            f"every {steps} steps ({_fmt_s(steps * self.iter_s)}): Young/Daly sqrt(2 x {self.checkpoint_cost_s:.3g} s "
            f"x MTTF {_fmt_s(self.mttf_s)}), MTTF = {self.per_device_mtbf_s / DAY_S:,.2f} d per device / "
            f"{self.devices} devices ({self.failures} failures observed)"
        )
        return IntervalDecision(
            steps,
            steps * self.iter_s,
            "failures",
            reason,
            {
                "mttf_s": self.mttf_s,
                "checkpoint_cost_s": self.checkpoint_cost_s,
                "devices": self.devices,
                "failures": self.failures,
            },
        )


class CombinedIntervalPolicy:
    """The binding constraint of the two: max(overhead floor, Young/Daly optimum)."""

    def __init__(self, checkfreq: CheckFreqPolicy, failures: YoungDalyInterval):
        self.checkfreq, self.failures = checkfreq, failures

    def observe_iteration(self, seconds: float) -> None:
        self.checkfreq.observe_iteration(seconds)
        iter_s = self.checkfreq.iter_s
        assert iter_s is not None  # it has just observed one
        self.failures.observe_iteration(iter_s)

    def observe_checkpoint(self, stall_s: float, persist_s: float) -> None:
        self.checkfreq.observe_checkpoint(stall_s, persist_s)
        stall = self.checkfreq.stall_s
        assert stall is not None  # it has just observed one
        self.failures.observe_checkpoint(stall)

    def observe_failure(self, count: int = 1) -> None:
        self.failures.observe_failure(count)

    def observe_uptime(self, wall_seconds: float) -> None:
        self.failures.observe_uptime(wall_seconds)

    def decide(self) -> IntervalDecision:
        floor = self.checkfreq.decide()
        if self.failures.checkpoint_cost_s is None or self.failures.iter_s is None:
            return floor
        optimum = self.failures.decide()
        chosen = optimum if optimum.steps > floor.steps and floor.binding != "max" else floor
        other = floor if chosen is optimum else optimum
        reason = (
            f"{chosen.reason}. Binding over the {other.binding} constraint (which alone gives {other.steps} steps)."
        )
        return IntervalDecision(
            chosen.steps,
            chosen.seconds,
            chosen.binding,
            reason,
            {"overhead_floor": floor.details, "young_daly": optimum.details},
        )
