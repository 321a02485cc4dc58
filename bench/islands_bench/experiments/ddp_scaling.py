"""ddp-scaling: one process against DDP at 2 and 4 workers on the same global batch (strong scaling)."""

from __future__ import annotations

import os

from islands.models import ByteTransformer, count_parameters
from islands_bench.harness import SMOKE_LM, BenchContext, experiment
from islands_bench.plots import figure


def _plot(result: dict, path) -> None:
    rows = result["rows"]
    labels = [f"{r['workers']}w {r['strategy']}\n{r['link']}" for r in rows]
    compute = [r["compute_s_per_step"] for r in rows]
    comm = [r["comm_s_per_step"] for r in rows]
    with figure(path, figsize=(6, 4)) as (fig, ax):
        ax.bar(labels, compute, label="compute (no collective in flight)")
        ax.bar(labels, comm, bottom=compute, label="collective in flight")
        ax.set_ylabel("seconds per step")
        ax.set_title(f"ddp-scaling, global batch {rows[0]['global_batch']}\n{result['interconnect'][-1]}", fontsize=8)
        ax.legend(fontsize=8)


@experiment(
    "ddp-scaling",
    practices=("SOTA-047", "SOTA-048", "Q-5"),
    help="steps/s and scaling efficiency of DDP at 1, 2, 4 workers on one global batch, against a "
    "per-worker and a per-node baseline; bytes/step vs analytic",
)
def ddp_scaling(ctx: BenchContext) -> dict:
    steps = 20 if ctx.quick else 60
    model = SMOKE_LM if ctx.smoke else {}
    common = dict(steps=steps, global_batch=32, eval_every=0, warmup=5, log_every=steps, **model)
    params = count_parameters(ByteTransformer(**model))
    analytic = 4 * params  # fp32 gradient payload each worker hands to all-reduce per step
    rows, base = [], None
    # the per-node baseline is one process using every core of this node, measured in the same run.
    cores = os.cpu_count() or 1
    node = ctx.train("single-node", workers=1, threads=cores, **common)["summary"]
    node_sps = 1.0 / node["median_seconds_per_step"]
    plans = [(1, False), (2, False)] if ctx.smoke else [(1, False), (2, False), (4, False)]  # smoke: 2 workers at most
    if ctx.rate:  # the same runs on the slow link, side by side with loopback
        plans += [(2, True), (4, True)]
    for workers, shaped in plans:
        if shaped:
            with ctx.testbed(ctx.rate, hosts=workers) as bed:
                rec = ctx.train(f"ddp-{workers}-{ctx.rate}", workers=workers, testbed=bed.name, **common)
        else:
            rec = ctx.train(f"{'single' if workers == 1 else 'ddp'}-{workers}", workers=workers, **common)
        s = rec["summary"]
        sps = 1.0 / s["median_seconds_per_step"]  # median: robust to other processes' bursts
        base = base or sps
        measured = s["bytes_sent_per_worker_per_step"]
        expect = analytic if workers > 1 else 0
        rows.append(
            {
                "workers": workers,
                "link": ctx.rate if shaped else "loopback",
                "strategy": s["strategy"],
                "global_batch": 32,
                "s_per_step": s["median_seconds_per_step"],
                "steps_per_s": sps,
                "speedup_vs_1_worker": sps / base,
                "efficiency": sps / base / workers,
                "speedup_vs_node": sps / node_sps,
                "compute_s_per_step": s["compute_seconds"] / s["steps"],
                "comm_s_per_step": s["comm_seconds"] / s["steps"],
                "comm_fraction": s["comm_fraction"],
                "bytes_per_step": measured,
                "analytic_bytes": expect,
                "bytes_match": measured == expect,
                "final_val_loss": s["final_val_loss"],
                "interconnect": rec["interconnect_line"],
            }
        )
    four = max((r for r in rows if r["link"] == "loopback"), key=lambda r: r["workers"])  # 4 workers (smoke: 2)
    per_node_eff = four["speedup_vs_node"] / (four["workers"] / cores)  # 4 workers fill 4/cores nodes
    headline = [
        f"Q-5, the same {four['workers']}-worker run against two baselines: {100 * four['efficiency']:.0f}% efficient "
        "per worker "
        f"(one 1-thread process = 1.00), {100 * per_node_eff:.0f}% per node (one {cores}-thread process = "
        f"{node_sps / base:.2f}x a worker); the two differ by {base * cores / node_sps:.2f}x, the factor by "
        f"which one process fails to use its node's cores",
        f"{four['workers']} workers on loopback: speed-up {four['speedup_vs_1_worker']:.2f}x over one worker "
        "(efficiency "
        f"{100 * four['efficiency']:.0f}%), baseline = one worker process with 1 thread; this machine has "
        f"{rec['versions']['cpu_count']} cores, so more than that many workers share cores",
        f"collective in flight {100 * four['comm_fraction']:.0f}% of step time at {four['workers']} workers on "
        f"{four['interconnect']}",
        f"bytes per step per worker equal the analytic fp32 payload ({analytic:,} B = 4 x {params:,} params): "
        f"{all(r['bytes_match'] for r in rows)}",
    ]
    for slow in (r for r in rows if r["link"] != "loopback"):
        fast = next(r for r in rows if r["workers"] == slow["workers"] and r["link"] == "loopback")
        headline.append(
            f"{slow['workers']} workers on {slow['interconnect']}: {slow['s_per_step']:.2f} s/step vs "
            f"{fast['s_per_step']:.2f} on loopback in the same run; collective in flight "
            f"{100 * slow['comm_fraction']:.0f}% of the step ({slow['comm_s_per_step']:.2f} s), so the slow link "
            f"costs {100 * (1 - fast['s_per_step'] / slow['s_per_step']):.0f}% of the step time"
        )
    return {"rows": rows, "headline": headline, "plot": _plot, "parameters": params}
