"""overlap-tau (SOTA-222): communication-to-computation ratio of overlap local SGD at tau 0, 1, 2.

Runs on a real rate-limited link (a network-namespace testbed, --testbed-rate or 100mbit) with two
islands of one worker. Within each run the trainer times how long the loop blocks inside the outer
strategy's after_step (the exchange, or the wait for one in flight); the ratio is
    comm_to_compute(tau) = blocked seconds / (wall seconds - blocked seconds)
measured inside one run, so it does not depend on how loaded the machine was in other runs.
tau 0 is a blocking average every step; tau 1 and 2 average every tau steps with the exchange
hidden behind the next tau steps.
"""

from __future__ import annotations

import os

from islands_bench.experiments.outer_common import gap_pct, row_of
from islands_bench.harness import BenchContext, experiment
from islands_bench.plots import figure

DEFAULT_RATE = "100mbit"


def _plot(result, path):
    rows = [r for r in result["rows"] if r["tau"] is not None]
    with figure(path, figsize=(5.5, 3.8)) as (fig, ax):
        ax.bar([f"tau={r['tau']}" for r in rows], [100 * r["comm_to_compute"] for r in rows])
        ax.set_ylabel("communication / computation (%)")
        ax.set_title(f"overlap-tau at {result['rate']}\n{result['interconnect'][-1]}", fontsize=8)


@experiment(
    "overlap-tau",
    practices=("SOTA-222",),
    help="overlap local SGD: communication-to-computation ratio at tau 0, 1, 2 on a rate-limited testbed link",
)
def overlap_tau(ctx: BenchContext) -> dict:
    rate = ctx.rate or DEFAULT_RATE
    steps = 24 if ctx.quick else 120
    # the default byte LM (0.9 M parameters, 3.5 MB per exchange): at 100mbit one exchange takes
    # about as long as one or two steps of compute on this machine, which is where overlap matters
    base = dict(
        task="lm",
        steps=steps,
        global_batch=32,
        warmup=max(steps // 10, 1),
        eval_every=0,
        workers=2,
        islands=2,
        log_every=max(steps // 12, 1),
    )
    runs = [
        ("compute-only", f"local-sgd:every={steps}", None),
        ("tau=0", "overlap-local-sgd:tau=0", 0),
        ("tau=1", "overlap-local-sgd:tau=1", 1),
        ("tau=2", "overlap-local-sgd:tau=2", 2),
    ]
    recs = {}
    load_before = os.getloadavg()[0]
    with ctx.testbed(rate, hosts=2) as bed:
        for label, spec, _ in runs:
            recs[label] = ctx.train(label, testbed=bed.name, outer=spec, **base)
    load = max(load_before, os.getloadavg()[0])
    rows = []
    for label, spec, tau in runs:
        s = recs[label]["summary"]
        blocked = s["sync_blocked_seconds"]
        rows.append(
            row_of(
                label,
                recs[label],
                tau=tau,
                spec=spec,
                comm_to_compute=blocked / max(s["wall_seconds"] - blocked, 1e-9),
                blocked_s_per_step=blocked / s["steps"],
                ledger_comm_fraction=s["comm_fraction"],
            )
        )
    compute = (recs["tau=0"]["summary"]["wall_seconds"] - recs["tau=0"]["summary"]["sync_blocked_seconds"]) / steps
    base_loss = rows[1]["final_val_loss"]
    for r in rows:
        r["loss_gap_vs_tau0_pct"] = gap_pct(r["final_val_loss"], base_loss)
    t0, t1, t2 = rows[1:]
    headline = [
        f"communication / computation on a {rate} testbed link (byte LM, 2 islands): tau 0 "
        f"{100 * t0['comm_to_compute']:.1f}%, "
        f"tau 1 {100 * t1['comm_to_compute']:.1f}%, tau 2 {100 * t2['comm_to_compute']:.1f}% "
        f"(SOTA-222's cited setting: 34.6% -> 1.5%); each ratio is blocked / unblocked time inside its own run",
        f"final val loss after {steps} steps: tau 0 {t0['final_val_loss']:.4f}, tau 1 {t1['final_val_loss']:.4f} "
        f"({t1['loss_gap_vs_tau0_pct']:+.1f}%), tau 2 {t2['final_val_loss']:.4f} ({t2['loss_gap_vs_tau0_pct']:+.1f}%); "
        f"interconnect: {t0['interconnect']}",
        f"tau 0 blocks, so its ledger time is pure waiting: {100 * t0['ledger_comm_fraction']:.1f}% of step time; "
        f"load average {load:.1f} on {os.cpu_count()} cores during the runs (compute per step at tau 0: "
        f"{1000 * compute:.0f} ms)",
    ]
    return {
        "rows": rows,
        "headline": headline,
        "plot": _plot,
        "rate": rate,
        "compute_s_per_step": compute,
        "load_average": load,
    }
