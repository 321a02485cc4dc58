"""heterogeneous: two islands, one computing 2x slower; time to DDP's loss for synchronous DiLoCo, speed-adaptive H and
the deadline rounds (SOTA-910, SOTA-911).

Arms, all 2 workers on gloo loopback with worker/island 1 slowed 2x (`slowdown`: a sleep after each forward and
backward, islands.faults.slowdown). Every step is first padded to a floor (quick 30 ms, full 250 ms) above its real
compute time: on a shared loaded host a process that never sleeps gets less CPU than one that sleeps half the time,
which would shrink a sleep-made 2x and time the host's load instead of the islands' speeds.
    ddp              one island of both workers: every step waits for the slow worker; its final val loss is the target
    diloco           2 islands, synchronous rounds of H steps: the fast island waits at every exchange
    diloco-speed     adapt=speed: the slow island plans H x (its speed / the fastest's) steps per round (DyLU)
    diloco-deadline  adapt=deadline: every island steps until the fastest island's time for H steps runs out
    diloco-deadline-eager  the same deadline rounds behind an overlapped exchange (overlap=eager, SOTA-912): no
                     island waits at a boundary, budgets follow one round later, each island catching up
    diloco-even      synchronous DiLoCo with no island slowed: the pace both islands could keep (reference)
Each arm evaluates the global model at every round's end (eval_every = H). Time to target is rank 0's training wall
time (evaluation excluded; waiting at exchanges included) at the first evaluation at or under the target; rank 0 is
on the fast island. The target is DDP's final val loss after its step budget; the DiLoCo arms get twice DDP's steps
(each on its own warm-up + cosine schedule) so that they can reach it; when synchronous DiLoCo still does not, the
target becomes its final loss (the headline says which), so the ratio always compares the same loss. The DiLoCo arms
run the same counted steps, the slow island computing fewer of them under adapt: the headline gives every arm's
final loss too. Quick: the digits MLP, DDP 300 steps, DiLoCo 600 at H=25; full: the default byte LM, DDP 1000 steps,
DiLoCo 2000 at H=100.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from islands_bench.experiments.outer_common import gap_pct, row_of
from islands_bench.harness import BenchContext, experiment
from islands_bench.plots import figure

FACTOR = 2.0  # the setting: one island 2x slower
LONGER = 2  # the DiLoCo arms' step budget over DDP's: room to reach DDP's loss (each stops counting once it has)


def base(ctx: BenchContext) -> tuple[dict, int, float]:
    """The shared config, H, and the floor (seconds) every step's forward and backward is padded to: above the real
    compute time even on a loaded shared host, so that the islands' speeds are the slowdown's, not the CPU shares
    other processes leave them (islands.faults.slowdown)."""
    if ctx.quick:
        h = 25
        return dict(task="digits", steps=300, global_batch=32, warmup=30, eval_every=h, workers=2, log_every=h), h, 0.03
    h = 100
    return dict(task="lm", steps=1000, global_batch=32, warmup=100, eval_every=h, workers=2, log_every=20), h, 0.25


def arms(ctx: BenchContext) -> list[tuple[str, dict]]:
    cfg, h, floor = base(ctx)
    slow, even = f"1={FACTOR},floor={floor}", f"floor={floor}"
    diloco = f"diloco:inner_steps={h}"
    longer = dict(cfg, islands=2, steps=LONGER * cfg["steps"])
    return [
        ("ddp", dict(cfg, islands=1, slowdown=f"rank1={FACTOR},floor={floor}")),
        ("diloco", dict(longer, outer=diloco, slowdown=slow)),
        ("diloco-speed", dict(longer, outer=f"{diloco},adapt=speed", slowdown=slow)),
        ("diloco-deadline", dict(longer, outer=f"{diloco},adapt=deadline", slowdown=slow)),
        ("diloco-deadline-eager", dict(longer, outer=f"{diloco},adapt=deadline,overlap=eager", slowdown=slow)),
        ("diloco-even", dict(longer, outer=diloco, slowdown=even)),
    ]


def time_to(series: list[dict], target: float) -> float | None:
    """Training seconds at the first evaluation at or under `target` (None: never reached)."""
    for point in series:
        if point["val_loss"] <= target:
            return float(point["elapsed"])
    return None


def steps_per_round(rec: dict) -> list[list[int]] | None:
    path = Path(rec.get("run_dir", "")) / "outer_exchanges.json"
    if not rec.get("run_dir") or not path.is_file():
        return None
    return json.loads(path.read_text()).get("steps_per_round")


def _plot(result, path):
    with figure(path, 1, 2, figsize=(10, 3.8)) as (fig, ax):
        for label, pts in result["val_series"].items():
            ax[0].plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=label)
        ax[0].axhline(result["target"], color="grey", lw=0.8, ls="--")
        ax[0].set_xlabel("training seconds (rank 0)")
        ax[0].set_ylabel("validation loss (log)")
        ax[0].set_yscale("log")
        ax[0].legend(fontsize=7)
        labels = [r["run"] for r in result["rows"]]
        ax[1].bar(labels, [r["time_to_target_s"] or 0 for r in result["rows"]])
        ax[1].set_ylabel("seconds to the target loss")
        ax[1].tick_params(axis="x", rotation=30, labelsize=7)
        fig.suptitle(
            f"heterogeneous{' (quick)' if result['quick'] else ''}: island 1 {FACTOR}x slower\n"
            f"{result['interconnect'][-1]}",
            fontsize=8,
        )


@experiment(
    "heterogeneous",
    practices=("SOTA-910", "SOTA-911"),
    help="one island 2x slower: time to DDP's loss for synchronous DiLoCo, speed-adaptive H and deadline rounds "
    "(also behind an overlapped exchange)",
)
def heterogeneous(ctx: BenchContext) -> dict:
    cfg, h, floor = base(ctx)
    if ctx.smoke:  # two rounds, so that speed-adaptive H and deadline rounds act
        ctx.smoke_steps = 2 * h
    plan = arms(ctx)
    ctx.plan(len(plan))
    load_before = os.getloadavg()[0]
    recs = {label: ctx.train(label, **overrides) for label, overrides in plan}
    load = max(load_before, os.getloadavg()[0])
    ran = any(r.get("launch_seconds", 0) > 0 for r in recs.values())  # --reuse: the load then says nothing
    final = {k: r["summary"]["final_val_loss"] for k, r in recs.items()}
    series = {k: r["series"]["val"] for k, r in recs.items()}
    target, target_from = final["ddp"], "DDP's final val loss"
    if time_to(series["diloco"], target) is None:
        target, target_from = final["diloco"], "synchronous DiLoCo's final val loss (it does not reach DDP's)"
    base_time = time_to(series["diloco"], target)
    rows, per_round = [], {}
    for label, _ in plan:
        rec = recs[label]
        t = time_to(series[label], target)
        rounds = steps_per_round(rec)
        s = rec["summary"]
        rows.append(
            row_of(
                label,
                rec,
                time_to_target_s=t,
                speedup_vs_diloco=(base_time / t) if t and base_time else None,
                wall_s=s["wall_seconds"],
                gap_vs_ddp_pct=gap_pct(final[label], final["ddp"]),
                sync_blocked_s=s["sync_blocked_seconds"],
                slow_island_steps=sum(r[1] for r in rounds) if rounds else None,
                fast_island_steps=sum(r[0] for r in rounds) if rounds else None,
            )
        )
        per_round[label] = rounds
    by = {r["run"]: r for r in rows}

    def arm(label: str) -> str:
        r = by[label]
        t = r["time_to_target_s"]
        reached = f"{t:.1f} s ({r['speedup_vs_diloco']:.2f}x sooner)" if t else "not reached"
        steps = (
            f", slow island {r['slow_island_steps']} of {r['fast_island_steps']} steps"
            if r["slow_island_steps"] is not None
            else ""
        )
        return f"{label} {reached}, final {r['final_val_loss']:.4f}{steps}"

    model = "digits MLP (quick; the byte LM runs without --quick)" if ctx.quick else "byte LM"
    words = (
        f"{model}, {cfg['global_batch']} samples per step, DDP {cfg['steps']} steps, DiLoCo "
        f"{LONGER * cfg['steps']} at H={h}, every step padded to {1000 * floor:.0f} ms"
    )
    headline = [
        f"island 1 {FACTOR}x slower ({words}, 2 workers, gloo loopback): time to the target {target:.4f} "
        f"({target_from}): "
        f"synchronous diloco {base_time:.1f} s; "
        + "; ".join(arm(k) for k in ("diloco-speed", "diloco-deadline", "diloco-deadline-eager"))
        + " (goal: >= 1.5x sooner)"
        if base_time
        else f"synchronous DiLoCo never reached the target {target:.4f} ({target_from})",
        f"final val loss: ddp {final['ddp']:.4f} in {by['ddp']['wall_s']:.1f} s, diloco {final['diloco']:.4f} in "
        f"{by['diloco']['wall_s']:.1f} s, speed {final['diloco-speed']:.4f} in {by['diloco-speed']['wall_s']:.1f} s, "
        f"deadline {final['diloco-deadline']:.4f} in {by['diloco-deadline']['wall_s']:.1f} s, deadline+eager "
        f"{final['diloco-deadline-eager']:.4f} in {by['diloco-deadline-eager']['wall_s']:.1f} s, no island slowed "
        f"{final['diloco-even']:.4f} in {by['diloco-even']['wall_s']:.1f} s; interconnect: "
        f"{by['diloco']['interconnect']}",
        f"times are rank 0's training seconds (evaluation excluded), on a shared {os.cpu_count()}-core host at load "
        + (f"average up to {load:.1f}" if ran else "average not measured (runs read back with --reuse)")
        + ": ratios within one invocation, each arm run once",
    ]
    return {
        "rows": rows,
        "headline": headline,
        "plot": _plot,
        "target": target,
        "target_from": target_from,
        "H": h,
        "factor": FACTOR,
        "floor_s": floor,
        "load_average": load if ran else None,
        "steps_per_round": {k: v for k, v in per_round.items() if v},  # [fast island, slow island] per round
        "val_series": {k: [(p["elapsed"], p["val_loss"]) for p in v] for k, v in series.items()},
    }
