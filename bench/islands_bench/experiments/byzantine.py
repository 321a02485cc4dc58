"""byzantine (SOTA-220): every attack against every aggregator at n = 8 workers, f in {0, 1, 2, 3}.

The grid (hundreds of training runs) is SIMULATED IN ONE PROCESS: islands_bench.byzantine_sim computes
the 8 workers' gradients on their own shards and runs the same attack and aggregator objects a real
job runs (bench/tests/test_byzantine_sim.py checks a simulated run against a real 4-rank one). A few
cells are then confirmed with real 8-process gloo jobs on digits (ctx.train), side by side with
their simulated twins. Aggregation time is measured per step against the mean of the same inputs.

Defender's settings: aggregators that take f are told the true f (trimmed mean trims max(f, 1) per
side, multi-Krum averages n - f); cclip uses tau = 1, the scale of the clipped gradient. Attack
settings: scaled sends -10 x its gradient (a positive factor under gradient clipping is still a
descent direction, so it tests nothing), gaussian sigma 1, ALIE with the paper's z_max, IPM eps 0.1.
The straggler is left out of the grid: it changes time, not values (tested on a real job instead).
"""

from __future__ import annotations

import math
import os
import statistics

from islands_bench.byzantine_sim import simulated_job
from islands_bench.harness import BenchContext, experiment
from islands_bench.plots import figure

N = 8
TOLERANCE = 0.05  # the goal: within 5% of the clean run's metric (issue 5, SOTA-220)
ATTACKS = [
    "sign-flip",
    "scaled:factor=-10",
    "gaussian:sigma=1",
    "alie",
    "ipm:eps=0.1",
    "nan",
    "inf",
    "dropout",
    "label-flip",
]
AGGREGATORS = [
    "mean",
    "median",
    "trimmed-mean",
    "krum",
    "multi-krum",
    "geomed",
    "cclip",
    "nnm+median",
    "bucketing+median",
]
# Per task: config of every run, and how to read the metric.
TASKS = {
    "digits": {
        "metric": "val_accuracy",
        "higher_is_better": True,
        "config": dict(task="digits", global_batch=64, steps=200, warmup=20),
    },
    "lm": {
        "metric": "val_loss",
        "higher_is_better": False,
        "config": dict(task="lm", global_batch=32, steps=150, warmup=15),
    },
}


def aggregator_spec(label: str, f: int) -> str:
    """The spec a defender who knows f (the usual assumption) would run."""
    return {
        "mean": "mean",
        "median": "median",
        "trimmed-mean": f"trimmed-mean:beta={max(f, 1) / N:g}",
        "krum": f"krum:f={f}",
        "multi-krum": f"multi-krum:f={f},m={N - f}",
        "geomed": "geomed",
        "cclip": "cclip:tau=1",
        "nnm+median": f"nnm:f={f}+median",
        "bucketing+median": "bucketing:s=2+median",
    }[label]


def attack_spec(name: str, f: int) -> str:
    if f == 0:
        return "none"
    return f"{name}{',' if ':' in name else ':'}count={f}"


def score(run: dict, higher: bool) -> float:
    """The run's metric, with a diverged or refused run scored as the worst possible value."""
    if run["diverged"] or run["error"]:
        return 0.0 if higher else math.inf
    return run["final_val_accuracy"] if higher else run["final_val_loss"]


def within(value: float, clean: float, higher: bool) -> bool:
    return value >= (1 - TOLERANCE) * clean if higher else value <= (1 + TOLERANCE) * clean


def relative(value: float, clean: float, higher: bool) -> float:
    """1.0 = as good as clean; lower is worse, for both kinds of metric."""
    if higher:
        return value / clean if clean else 0.0
    return clean / value if value and math.isfinite(value) else 0.0


def simulate_grid(
    ctx: BenchContext, task: str, fs: list[int], attacks: list[str], aggregators: list[str], steps: int
) -> list[dict]:
    cells = []
    for f in fs:
        for attack in ["none"] if f == 0 else attacks:
            for label in aggregators:
                cfg = ctx.config(
                    **{
                        **TASKS[task]["config"],
                        "steps": steps,
                        "workers": N,
                        "eval_every": 0,
                        "probe": False,
                        "threads": 1,
                    }
                )
                run = simulated_job(cfg, aggregator_spec(label, f), attack_spec(attack, f)).run(steps).to_dict()
                run.update(task=task, f=f, attack_name=attack if f else "none", aggregator=label)
                cells.append(run)
            ctx.log(
                f"simulated {task} f={f} {attack}: "
                + ", ".join(
                    f"{c['aggregator']}={score(c, TASKS[task]['higher_is_better']):.3f}"
                    for c in cells[-len(aggregators) :]
                )
            )
    return cells


def pivot(cells: list[dict], task: str) -> tuple[list[dict], float]:
    """One row per (f, attack): every aggregator's metric, the best robust one, and the verdicts."""
    higher = TASKS[task]["higher_is_better"]
    mine = [c for c in cells if c["task"] == task]
    clean = score(next(c for c in mine if c["f"] == 0 and c["aggregator"] == "mean"), higher)
    rows = []
    for f in sorted({c["f"] for c in mine}):
        for attack in dict.fromkeys(c["attack_name"] for c in mine if c["f"] == f):
            group = {c["aggregator"]: score(c, higher) for c in mine if c["f"] == f and c["attack_name"] == attack}
            robust = {k: v for k, v in group.items() if k != "mean"}
            best = (max if higher else min)(robust, key=robust.get)
            rows.append(
                {
                    "task": task,
                    "metric": TASKS[task]["metric"],
                    "f": f,
                    "attack": attack,
                    **group,
                    "clean": clean,
                    "best": best,
                    "best_vs_clean": relative(robust[best], clean, higher),
                    "best_ok": within(robust[best], clean, higher),
                    "mean_vs_clean": relative(group["mean"], clean, higher),
                    "mean_ok": within(group["mean"], clean, higher),
                }
            )
    return rows, clean


def cost_ratios(cells: list[dict]) -> dict[str, dict]:
    """Per aggregator: median over its runs of (time in aggregator / time of mean on the same inputs)."""
    out = {}
    for label in dict.fromkeys(c["aggregator"] for c in cells):
        mine = [c for c in cells if c["aggregator"] == label and c["steps"]]
        out[label] = {
            "ratio_to_mean": statistics.median(c["cost_vs_mean"] for c in mine),
            "ms_per_step": 1e3 * statistics.median(c["aggregate_step_seconds"] for c in mine),
            "mean_ms_per_step": 1e3 * statistics.median(c["mean_step_seconds"] for c in mine),
            "runs": len(mine),
        }
    return out


def time_aggregators(
    ctx: BenchContext, task: str, f: int, attack: str, aggregators: list[str], rounds: int
) -> dict[str, dict]:
    """Aggregation time on ONE set of real inputs (n gradients of `task`, f of them forged by `attack`),
    every aggregator timed in turn within each round so that machine load hits them alike; the
    per-aggregator minimum over rounds is the cost (as timeit does), divided by the mean's."""
    import time

    from islands.aggregate import parse_aggregator

    cfg = ctx.config(**{**TASKS[task]["config"], "workers": N, "eval_every": 0, "probe": False, "threads": 1})
    sim = simulated_job(cfg, "mean", attack_spec(attack, f))
    sent = sim.plan.corrupt_all([sim.worker_gradient(r)[0] for r in range(N)])
    aggs = {label: parse_aggregator(aggregator_spec(label, f)) for label in aggregators}
    best = {label: math.inf for label in aggregators}
    for i in range(rounds):
        order = aggregators[i % len(aggregators) :] + aggregators[: i % len(aggregators)]  # rotate who goes first
        for label in order:
            t0 = time.perf_counter()
            aggs[label].aggregate(sent)
            best[label] = min(best[label], time.perf_counter() - t0)
    return {label: {"ratio_to_mean": best[label] / best["mean"], "ms": 1e3 * best[label]} for label in aggregators}


def confirm_real(ctx: BenchContext, rows: list[dict], cells: list[dict], attacks: list[str], steps: int) -> list[dict]:
    """Real 8-process gloo jobs on digits for chosen f=2 cells: mean, median and the best robust one."""
    digits = TASKS["digits"]
    out = []
    for attack in attacks:
        row = next(r for r in rows if r["task"] == "digits" and r["f"] == 2 and r["attack"] == attack)
        for label in dict.fromkeys(["mean"] if ctx.smoke else ["mean", "median", row["best"]]):  # smoke: one 8-rank job
            agg, att = aggregator_spec(label, 2), attack_spec(attack, 2)
            rec = ctx.train(
                f"real-{attack.split(':')[0]}-{label}",
                **{**digits["config"], "steps": steps},
                workers=N,
                eval_every=0,
                log_every=steps,
                aggregate=agg,
                attack=att,
                threads=1,
            )
            twin = next(
                c
                for c in cells
                if c["task"] == "digits" and c["f"] == 2 and c["attack_name"] == attack and c["aggregator"] == label
            )
            s = rec["summary"]
            out.append(
                {
                    "attack": att,
                    "aggregate": agg,
                    "real_accuracy": s["final_val_accuracy"],
                    "simulated_accuracy": twin["final_val_accuracy"],
                    "real_seconds_per_step": s["seconds_per_step"],
                    "interconnect": rec["interconnect_line"],
                }
            )
    return out


def _plot(result: dict, path) -> None:
    rows = result["rows"]
    panels = [
        (t, f)
        for t in dict.fromkeys(r["task"] for r in rows)
        for f in sorted({r["f"] for r in rows if r["task"] == t})
        if f
    ]
    with figure(path, 1, len(panels) + 1, figsize=(4.6 * (len(panels) + 1), 4.4), squeeze=False) as (fig, axes):
        for ax, (task, f) in zip(axes[0], panels):
            mine = [r for r in rows if r["task"] == task and r["f"] == f]
            higher = TASKS[task]["higher_is_better"]
            grid = [[relative(r[a], r["clean"], higher) for a in AGGREGATORS if a in r] for r in mine]
            labels = [a for a in AGGREGATORS if a in mine[0]]
            im = ax.imshow(grid, vmin=0.5, vmax=1.0, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
            ax.set_yticks(range(len(mine)), [r["attack"] for r in mine], fontsize=7)
            for i, line in enumerate(grid):
                for j, v in enumerate(line):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=5.5)
            ax.set_title(f"{task}, f={f} of {N}: {TASKS[task]['metric']} vs clean", fontsize=8)
        fig.colorbar(im, ax=axes[0][len(panels) - 1], fraction=0.04)
        ax = axes[0][-1]
        for k, (task, cost) in enumerate(result["aggregation_cost"].items()):
            ys = [i + 0.4 * k for i in range(len(cost))]
            ax.barh(ys, [c["ratio_to_mean"] for c in cost.values()], height=0.4, label=task)
        ax.set_yticks(range(len(cost)), list(cost))
        ax.set_xscale("log")
        ax.legend(fontsize=7)
        ax.set_xlabel("aggregation time / mean's, same inputs", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_title("aggregation cost vs mean (best of rounds)", fontsize=8)
        fig.suptitle(
            "byzantine: grid simulated in one process (n=8); see summary for real gloo confirmations", fontsize=9
        )


def headline(rows: list[dict], cost: dict, real: list[dict], tasks: list[str], steps: dict) -> list[str]:
    lines = [
        f"The attack x aggregator x f grid is SIMULATED IN ONE PROCESS (n={N} workers' gradients on their own "
        f"shards, the real AttackPlan and aggregator code); tasks {', '.join(tasks)}, steps "
        + ", ".join(f"{t} {s}" for t, s in steps.items())
        + "; only the confirmations below ran as real processes."
    ]
    for task in tasks:
        low = [r for r in rows if r["task"] == task and 1 <= r["f"] <= 2]
        ok = [r for r in low if r["best_ok"]]
        miss = [
            f"{r['attack']} f={r['f']} (best {r['best']} {r['best_vs_clean']:.2f}x)" for r in low if not r["best_ok"]
        ]
        mean_fails = [f"{r['attack']} f={r['f']} ({r['mean_vs_clean']:.2f}x)" for r in low if not r["mean_ok"]]
        clean = low[0]["clean"] if low else float("nan")
        goal = bool(low) and len(ok) == len(low) and bool(mean_fails)
        lines.append(
            f"{task} (clean {TASKS[task]['metric']} {clean:.4f}): with f <= 2 of {N}, the best robust "
            f"aggregator stays within {TOLERANCE:.0%} of clean in {len(ok)}/{len(low)} (attack, f) cells"
            + (f"; misses: {'; '.join(miss)}" if miss else "")
            + f"; mean falls outside {TOLERANCE:.0%} under {len(mean_fails)}: {'; '.join(mean_fails) or 'none'}"
            + f". Goal {'MET' if goal else 'NOT MET'} (ratios are metric vs clean, 1.00 = clean)."
        )
        zero = next((r for r in rows if r["task"] == task and r["f"] == 0), None)
        if zero:
            lines.append(
                f"{task}, all honest (f=0), metric vs clean per aggregator: "
                + ", ".join(
                    f"{a} {relative(zero[a], zero['clean'], TASKS[task]['higher_is_better']):.3f}"
                    for a in AGGREGATORS
                    if a in zero
                )
            )
        three = [r for r in rows if r["task"] == task and r["f"] == 3]
        if three:
            lines.append(
                f"{task}, f=3 of {N} (beyond Krum's n > 2f+2 bound): best within {TOLERANCE:.0%} of clean in "
                f"{sum(r['best_ok'] for r in three)}/{len(three)} attacks"
            )
    for task, timing in cost.items():
        lines.append(
            f"{task}: aggregation time relative to mean, one step's {N} gradients (f=2 sign-flip), all timed "
            "in turn in this run, best of the rounds: "
            + ", ".join(f"{a} {c['ratio_to_mean']:.2f}x" for a, c in timing.items())
            + f" (mean {timing['mean']['ms']:.3f} ms)"
        )
    for r in real:
        lines.append(
            f"real {N}-process gloo run, digits, {r['attack']} + {r['aggregate']}: accuracy "
            f"{r['real_accuracy']:.3f} (simulated twin {r['simulated_accuracy']:.3f}), "
            f"{r['real_seconds_per_step']:.3f} s/step"
        )
    return lines


@experiment(
    "byzantine",
    practices=("SOTA-220",),
    help="n=8, f in 0..3: every attack vs every aggregator (grid simulated in one process, "
    "real gloo confirmations); final metric vs clean and aggregation cost vs mean",
)
def byzantine(ctx: BenchContext) -> dict:
    if ctx.quick:
        tasks, fs, steps = ["digits"], [0, 2], {"digits": 2 if ctx.smoke else 100}
        real_attacks = None  # chosen below: the attack that hurts mean most
    else:
        tasks, fs = ["digits", "lm"], [0, 1, 2, 3]
        steps = {t: TASKS[t]["config"]["steps"] for t in tasks}
        real_attacks = ["sign-flip", "alie"]
    load_before = os.getloadavg()[0]
    cells, rows = [], []
    for task in tasks:
        cells += simulate_grid(ctx, task, fs, ATTACKS, AGGREGATORS, steps[task])
        rows += pivot(cells, task)[0]
    digits_f2 = [r for r in rows if r["task"] == "digits" and r["f"] == 2]
    worst = min(digits_f2, key=lambda r: r["mean_vs_clean"])["attack"]
    chosen = list(dict.fromkeys([worst] + (real_attacks or [])))
    real = confirm_real(ctx, rows, cells, chosen, steps["digits"])
    cost = {
        t: time_aggregators(ctx, t, 2, "sign-flip", AGGREGATORS, 2 if ctx.smoke else 15 if ctx.quick else 40)
        for t in tasks
    }
    load = {"before": load_before, "after": os.getloadavg()[0], "cpus": os.cpu_count()}
    lines = headline(rows, cost, real, tasks, steps)
    lines.append(
        f"machine load average {load['before']:.1f} before / {load['after']:.1f} after on {load['cpus']} CPUs "
        "(other jobs share it): absolute times are inflated; ratios compare like with like"
    )
    return {
        "rows": rows,
        "headline": lines,
        "plot": _plot,
        "load_average": load,
        "simulated": True,
        "workers": N,
        "tolerance": TOLERANCE,
        "aggregation_cost": cost,
        "aggregation_cost_per_run": cost_ratios(cells),
        "real_confirmations": real,
        "cells": cells,
        "aggregator_specs": {f: {a: aggregator_spec(a, f) for a in AGGREGATORS} for f in fs},
    }


# The LM half of the grid at a size one session can run: the attacks that separate aggregators on
# digits, against the aggregators that survive them there, f in {0, 2}, fewer steps.
LM_ATTACKS = ["sign-flip", "scaled:factor=-10", "alie", "label-flip"]
LM_AGGREGATORS = ["mean", "median", "trimmed-mean", "cclip"]


@experiment(
    "byzantine-lm",
    practices=("SOTA-220",),
    help="the byzantine grid's language-model half at reduced size: n=8, f in {0, 2}, four attacks x four "
    "aggregators on the default byte LM (simulated in one process)",
)
def byzantine_lm(ctx: BenchContext) -> dict:
    steps = 1 if ctx.smoke else 30 if ctx.quick else TASKS["lm"]["config"]["steps"]
    load_before = os.getloadavg()[0]
    attacks = LM_ATTACKS[:1] if ctx.smoke else LM_ATTACKS
    cells = simulate_grid(ctx, "lm", [0, 2], attacks, LM_AGGREGATORS, steps)
    rows = pivot(cells, "lm")[0]
    cost = {
        "lm": time_aggregators(ctx, "lm", 2, "sign-flip", LM_AGGREGATORS, 1 if ctx.smoke else 10 if ctx.quick else 30)
    }
    lines = headline(rows, cost, [], ["lm"], {"lm": steps})
    lines.append(
        f"reduced grid: attacks {', '.join(LM_ATTACKS)}; aggregators {', '.join(LM_AGGREGATORS)}; "
        f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    return {
        "rows": rows,
        "headline": lines,
        "plot": _plot,
        "simulated": True,
        "workers": N,
        "tolerance": TOLERANCE,
        "aggregation_cost": cost,
        "cells": cells,
    }
