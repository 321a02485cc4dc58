"""muloco: DiLoCo with Muon inner steps (MuLoCo, LIT-901) against DiLoCo with AdamW inner steps, at the same H.

Six arms on the byte LM, 2 workers: DDP with AdamW and with Muon (the data-parallel references, one island), then
DiLoCo over 2 islands of one worker with AdamW inside and with Muon inside (`--optimizer muon`:
islands.optim.MuonAdamW, Muon on the hidden matrices, AdamW on the rest, the job's lr for both), each with fp32
deltas and with int4 deltas under error feedback (`compressor=(int4:ef=true)`). Every DiLoCo arm takes DiLoCo's
default outer step (plain SGD, lr sqrt(2)). Quick runs a small LM (d 64, 2 layers, context 64) for 300 steps so
that six arms fit in minutes on two cores; full runs the default LM for 1000 steps at H=100.
"""

from __future__ import annotations

import math

from islands_bench.experiments.outer_common import bar_plot, gap_pct, row_of
from islands_bench.harness import BenchContext, experiment

COMPRESSOR = "int4:ef=true"  # 4-bit codes against a shared scale, error feedback per island


def _plot(result, path):
    bar_plot(result, path, "bytes_per_worker", "bytes sent per worker (log)", log=True)


def base(ctx: BenchContext) -> tuple[dict, int]:
    if ctx.quick:
        return dict(
            task="lm",
            d_model=64,
            n_layers=2,
            n_heads=4,
            context=64,
            steps=300,
            global_batch=16,
            warmup=30,
            eval_every=50,
            eval_batches=8,
            workers=2,
            log_every=15,
        ), 50
    return dict(task="lm", steps=1000, global_batch=32, warmup=100, eval_every=100, workers=2, log_every=20), 100


def arms(ctx: BenchContext) -> list[tuple[str, dict, dict]]:
    """(label, config overrides, row extras) of every arm, the references first."""
    cfg, h = base(ctx)
    out = [
        (f"ddp-{opt}", dict(cfg, islands=1, optimizer=opt), dict(optimizer=opt, H=1, compressor="none"))
        for opt in ("adamw", "muon")
    ]
    for comp in ("none", COMPRESSOR):
        outer = f"diloco:inner_steps={h}" + ("" if comp == "none" else f",compressor=({comp})")
        for opt, name in (("adamw", "diloco"), ("muon", "muloco")):
            label = name + ("" if comp == "none" else "-int4ef")
            out.append(
                (label, dict(cfg, islands=2, optimizer=opt, outer=outer), dict(optimizer=opt, H=h, compressor=comp))
            )
    return out


@experiment(
    "muloco",
    practices=("SOTA-901",),
    help="MuLoCo (DiLoCo with Muon inner steps) vs DiLoCo with AdamW inside at the same H, fp32 and int4+EF "
    "deltas, with DDP-AdamW and DDP-Muon references: final val loss and bytes",
)
def muloco(ctx: BenchContext) -> dict:
    cfg, h = base(ctx)
    if ctx.smoke:  # two rounds
        ctx.smoke_steps = 2 * h
    plan = arms(ctx)
    ctx.plan(len(plan))
    rows = []
    for label, overrides, extras in plan:
        rec = ctx.train(label, **overrides)
        row = row_of(label, rec, **extras)
        if extras["H"] > 1:  # a compressed round is counted under the compressor's ledger kinds (compress_*), which
            # row_of's outer kinds miss: every byte a DiLoCo worker sends is outer traffic, over ceil(steps / H) rounds
            row["syncs"] = math.ceil(cfg["steps"] / extras["H"])
            row["bytes_per_sync"] = row["bytes_per_worker"] / row["syncs"]
        rows.append(row)
    by = {r["run"]: r for r in rows}
    ref = by["ddp-adamw"]
    for r in rows:
        own = by[f"ddp-{r['optimizer']}"]
        r["loss_gap_pct"] = gap_pct(r["final_val_loss"], ref["final_val_loss"])  # against DDP-AdamW
        r["gap_vs_own_ddp_pct"] = gap_pct(r["final_val_loss"], own["final_val_loss"])
        r["bytes_ratio_ddp_over_run"] = ref["bytes_per_worker"] / max(r["bytes_per_worker"], 1)
    words = (
        f"byte LM d{cfg.get('d_model', 128)} L{cfg.get('n_layers', 4)} ctx{cfg.get('context', 128)}, "
        f"{cfg['steps']} steps x {cfg['global_batch']} sequences, 2 workers"
    )

    def vs(a: str, b: str) -> str:
        x, y = by[a], by[b]
        return (
            f"{x['final_val_loss']:.4f} vs {y['final_val_loss']:.4f} "
            f"({gap_pct(x['final_val_loss'], y['final_val_loss']):+.1f}%)"
        )

    headline = [
        f"MuLoCo vs DiLoCo-AdamW at H={h} ({words}, 2 islands, DiLoCo's default outer step): fp32 deltas "
        f"{vs('muloco', 'diloco')}; int4+EF deltas {vs('muloco-int4ef', 'diloco-int4ef')}; "
        f"interconnect: {ref['interconnect']}",
        f"bytes per worker: DDP {ref['bytes_per_worker']:,}, DiLoCo fp32 {by['diloco']['bytes_per_worker']:,} "
        f"({by['diloco']['bytes_ratio_ddp_over_run']:.0f}x fewer), int4+EF {by['diloco-int4ef']['bytes_per_worker']:,} "
        f"({by['diloco-int4ef']['bytes_ratio_ddp_over_run']:.0f}x fewer); Muon and AdamW arms send the same bytes",
        f"data-parallel references: DDP-Muon vs DDP-AdamW {vs('ddp-muon', 'ddp-adamw')}; DiLoCo's gap to its own "
        f"optimizer's DDP: AdamW {by['diloco']['gap_vs_own_ddp_pct']:+.1f}%, Muon "
        f"{by['muloco']['gap_vs_own_ddp_pct']:+.1f}%",
    ]
    return {"rows": rows, "headline": headline, "plot": _plot}
