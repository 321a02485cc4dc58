"""fsdp-outer: FSDP inside each island, DiLoCo across islands per shard, against DDP inside with the same DiLoCo
(SOTA-935). Two islands of two workers on the byte LM, the same data, steps and outer step: the final loss (the
global model, gathered) and what crosses between islands per worker (each fsdp worker sends its 1/N shard of
the delta, each ddp worker the whole model), side by side in one invocation."""

from __future__ import annotations

from islands_bench.experiments.outer_common import gap_pct, row_of
from islands_bench.harness import BenchContext, experiment


def base(ctx: BenchContext) -> tuple[dict, int]:
    if ctx.quick:
        return dict(
            task="lm",
            d_model=64,
            n_layers=2,
            n_heads=4,
            context=64,
            steps=60,
            global_batch=16,
            warmup=6,
            eval_batches=8,
            workers=4,
            islands=2,
            log_every=10,
        ), 10
    return dict(task="lm", steps=400, global_batch=32, warmup=40, workers=4, islands=2, log_every=20), 50


@experiment(
    "fsdp-outer",
    practices=("SOTA-935",),
    help="FSDP inside islands with DiLoCo across per shard vs DDP inside with the same DiLoCo: final val loss "
    "and cross-island bytes per worker",
)
def fsdp_outer(ctx: BenchContext) -> dict:
    cfg, h = base(ctx)
    if ctx.smoke:  # two rounds
        ctx.smoke_steps = 2 * h
    ctx.plan(2)
    rows = []
    for inner in ("ddp", "fsdp"):
        rec = ctx.train(f"{inner}-diloco", **cfg, inner=inner, outer=f"diloco:inner_steps={h}")
        rows.append(
            row_of(
                f"{inner}-diloco",
                rec,
                inner=inner,
                H=h,
                cross_island_bytes_per_worker=int(rec["summary"]["cross_island_mb_per_worker"] * 1e6),
            )
        )
    ddp, fsdp = rows
    gap = gap_pct(fsdp["final_val_loss"], ddp["final_val_loss"])
    ratio = ddp["cross_island_bytes_per_worker"] / max(fsdp["cross_island_bytes_per_worker"], 1)
    headline = [
        f"fsdp inside + DiLoCo per shard vs ddp inside + DiLoCo (byte LM, {cfg['steps']} steps, H={h}, 2 islands x 2 "
        f"workers): final val loss {fsdp['final_val_loss']:.6f} vs {ddp['final_val_loss']:.6f} ({gap:+.4f}%); "
        f"cross-island bytes per worker {fsdp['cross_island_bytes_per_worker']:,} vs "
        f"{ddp['cross_island_bytes_per_worker']:,} ({ratio:.2f}x fewer); interconnect: {ddp['interconnect']}",
    ]
    return {
        "rows": rows,
        "headline": headline,
        "loss_gap_pct": gap,
        "cross_bytes_ratio": ratio,
        "interconnect": [ddp["interconnect"]],
        "baseline": ["ddp inside each island with the same DiLoCo rounds, data and steps, in this invocation"],
    }
