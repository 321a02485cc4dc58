"""ckpt-interval (SOTA-054, SOTA-189): expected lost work plus checkpoint overhead, policy vs fixed intervals.

Failures arrive as a Poisson process at devices / per-device MTBF (3,748.25 days per device, LIT-222),
from 8 to 16,384 devices. The simulated job (islands.checkpoint.policy.simulate_failures) must finish a fixed
amount of useful work; each checkpoint stalls it, becomes durable after an asynchronous persist, and a
failure loses the work since the last durable checkpoint plus a restart. Stated job model (a large
synchronous job, not this machine): 1 s per step, 10 s stall per checkpoint, 60 s persist, 300 s
restart, two weeks of useful work. The policy is CombinedIntervalPolicy (overhead bound 3.5% from
profiled numbers, Young/Daly from the job's size, updated by the failures it sees); the fixed
intervals are the kind of settings people pick by hand. Each point is the mean over seeds.
"""

from __future__ import annotations

import random
import statistics

from islands.checkpoint.policy import (
    DEFAULT_DEVICE_MTBF_DAYS,
    CheckFreqPolicy,
    CombinedIntervalPolicy,
    YoungDalyInterval,
    simulate_failures,
)
from islands_bench.harness import BenchContext, experiment
from islands_bench.plots import figure

ITER_S, STALL_S, PERSIST_S, RESTART_S = 1.0, 10.0, 60.0, 300.0  # stated job model (module docstring)
DAY_S = 86400.0
HOURS = 14 * 24.0
FIXED = {"fixed 5 min": 300, "fixed 30 min": 1800, "fixed 1 h": 3600, "fixed 6 h": 21600}


def make_policy(devices: int) -> CombinedIntervalPolicy:
    checkfreq = CheckFreqPolicy(max_steps=10**7)
    failures = YoungDalyInterval(devices)
    policy = CombinedIntervalPolicy(checkfreq, failures)
    policy.observe_iteration(ITER_S)  # what online profiling would have measured for this job
    policy.observe_checkpoint(STALL_S, PERSIST_S)
    return policy


def _plot(result: dict, path) -> None:
    rows = result["rows"]
    with figure(path, figsize=(6.5, 4)) as (fig, ax):
        for label in dict.fromkeys(r["policy"] for r in rows):
            pts = [(r["devices"], 100 * r["waste_fraction"]) for r in rows if r["policy"] == label]
            ax.plot(*zip(*pts), marker="o", label=label, linewidth=2.5 if label == "policy" else 1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("devices in the job")
        ax.set_ylabel("lost work + checkpoint overhead + restarts (% of wall time)")
        ax.set_title(f"ckpt-interval: MTBF {DEFAULT_DEVICE_MTBF_DAYS} d/device, stall {STALL_S:.0f} s", fontsize=9)
        ax.legend(fontsize=8)


@experiment(
    "ckpt-interval",
    practices=("SOTA-054", "SOTA-189"),
    help="simulated failures at 8..16,384 devices: lost work + overhead of the interval policy vs fixed",
)
def ckpt_interval(ctx: BenchContext) -> dict:
    device_counts = [8, 64, 512, 4096, 16384] if ctx.quick else [8, 32, 128, 512, 2048, 8192, 16384]
    seeds = 12 if ctx.quick else 60
    rows = []
    for devices in device_counts:
        policies = {
            "policy": lambda devices=devices: make_policy(devices),
            **{k: (lambda v=v: v) for k, v in FIXED.items()},
        }
        for label, make in policies.items():
            runs = [
                simulate_failures(
                    make(),
                    devices,
                    HOURS,
                    random.Random(1000 * devices + s),
                    iter_s=ITER_S,
                    stall_s=STALL_S,
                    persist_s=PERSIST_S,
                    restart_s=RESTART_S,
                )
                for s in range(seeds)
            ]
            wall = statistics.fmean(r.wall_s for r in runs)
            rows.append(
                {
                    "devices": devices,
                    "policy": label,
                    "mttf_h": DEFAULT_DEVICE_MTBF_DAYS * DAY_S / devices / 3600,
                    "interval_s": statistics.fmean(r.mean_interval_steps for r in runs) * ITER_S,
                    "failures": statistics.fmean(r.failures for r in runs),
                    "lost_work_h": statistics.fmean(r.lost_work_s for r in runs) / 3600,
                    "overhead_h": statistics.fmean(r.overhead_s for r in runs) / 3600,
                    "restart_h": statistics.fmean(r.restart_s for r in runs) / 3600,
                    "wall_h": wall / 3600,
                    "waste_fraction": statistics.fmean(r.waste_fraction for r in runs),
                    "seeds": seeds,
                }
            )
        ours = next(r for r in rows if r["devices"] == devices and r["policy"] == "policy")
        ctx.log(
            f"{devices} devices: policy every {ours['interval_s'] / 60:.1f} min, waste "
            f"{100 * ours['waste_fraction']:.2f}%"
        )
    headline = []
    for devices in device_counts:
        group = [r for r in rows if r["devices"] == devices]
        ours = next(r for r in group if r["policy"] == "policy")
        best = min((r for r in group if r["policy"] != "policy"), key=lambda r: r["waste_fraction"])
        worst = max((r for r in group if r["policy"] != "policy"), key=lambda r: r["waste_fraction"])
        headline.append(
            f"{devices} devices (MTTF {ours['mttf_h']:.1f} h): policy checkpoints every "
            f"{ours['interval_s'] / 60:.1f} min, waste {100 * ours['waste_fraction']:.2f}% vs best fixed "
            f"({best['policy']}) {100 * best['waste_fraction']:.2f}% "
            f"({ours['waste_fraction'] / best['waste_fraction']:.2f}x) and worst fixed ({worst['policy']}) "
            f"{100 * worst['waste_fraction']:.2f}%"
        )
    return {
        "rows": rows,
        "headline": headline,
        "plot": _plot,
        "job_model": {
            "iter_s": ITER_S,
            "stall_s": STALL_S,
            "persist_s": PERSIST_S,
            "restart_s": RESTART_S,
            "useful_hours": HOURS,
            "per_device_mtbf_days": DEFAULT_DEVICE_MTBF_DAYS,
        },
        "interconnect": ["none: simulation"],
        "baseline": ["fixed checkpoint intervals of 5 min, 30 min, 1 h and 6 h in the same simulated jobs and seeds"],
    }
