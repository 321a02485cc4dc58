"""zero1-memory (SOTA-028): ZeRO stage 1 against DDP at 2 and 4 workers, one invocation.

Same model, batch, seed and AdamW for both. Reported per run: final validation loss, optimizer-state
bytes per rank (the largest partition's AdamW slots, from the same deterministic partition the strategy
uses; tests/integration/sharding/test_zero1.py checks it against the state the optimizer really
allocates), payload bytes per step per kind from rank 0's ledger, ring wire bytes, and the median step time.
"""

from __future__ import annotations

import os

from islands.models import ByteTransformer
from islands.sync import partition
from islands_bench.experiments.sharding_common import lm_config, median_step_seconds, ratio
from islands_bench.harness import BenchContext, experiment


def _optimizer_bytes_per_rank(cfg: dict, n: int) -> int:
    """AdamW's two fp32 slots of the largest partition (n=1: every parameter, DDP)."""
    model = ByteTransformer(cfg["d_model"], cfg["n_layers"], cfg["n_heads"], cfg["context"])
    numels = [p.numel() for p in model.parameters()]
    owner = partition(numels, n)
    return 2 * 4 * max(sum(x for x, o in zip(numels, owner) if o == r) for r in range(n))


def _row(ctx: BenchContext, label: str, cfg: dict) -> dict:
    load = os.getloadavg()[0]
    rec = ctx.train(label, **cfg)
    n, steps = cfg["workers"], rec["summary"]["steps"]
    sent, received = rec["comm"]["per_rank"][0]["sent"], rec["comm"]["per_rank"][0]["received"]
    ar, gather_in = sent.get("grad_all_reduce", 0) / steps, received.get("zero1_param_gather", 0) / steps
    zero1 = cfg["inner"] == "zero1"
    return {
        "run": label,
        "strategy": cfg["inner"],
        "workers": n,
        "optimizer_mb_per_rank": _optimizer_bytes_per_rank(cfg, n if zero1 else 1) / 1e6,
        "grad_all_reduce_mb_per_step": ar / 1e6,
        "param_gather_mb_per_step": (sent.get("zero1_param_gather", 0) / steps) / 1e6,
        "wire_mb_per_step": (2 * (n - 1) / n * ar + gather_in) / 1e6,  # ring all-reduce + all-gather received
        "s_per_step": median_step_seconds(rec),
        "final_val_loss": rec["summary"]["final_val_loss"],
        "load_avg": load,
        "interconnect": rec["interconnect_line"],
    }


@experiment(
    "zero1-memory",
    practices=("SOTA-028",),
    help="ZeRO-1 vs DDP: optimizer state per rank, loss, bytes and step time at 2 and 4 workers",
)
def zero1_memory(ctx: BenchContext) -> dict:
    d, layers, steps = (128, 2, 12) if ctx.quick else (256, 4, 60)
    sizes = (2,) if ctx.smoke else (2, 4)  # smoke: 2 workers
    rows = []
    for n in sizes:
        for inner in ("ddp", "zero1"):
            cfg = lm_config(d, layers, steps, n, inner=inner)
            cfg["eval_every"], cfg["eval_batches"] = steps, 2
            rows.append(_row(ctx, f"{inner}-{n}", cfg))
    headline = []
    for n in sizes:
        dd, z = (next(r for r in rows if r["workers"] == n and r["strategy"] == s) for s in ("ddp", "zero1"))
        headline.append(
            f"{n} workers: optimizer state per rank {z['optimizer_mb_per_rank']:.2f} MB vs DDP's "
            f"{dd['optimizer_mb_per_rank']:.2f} MB "
            f"({ratio(dd['optimizer_mb_per_rank'], z['optimizer_mb_per_rank']):.2f}x less); "
            f"final val loss {z['final_val_loss']:.4f} vs {dd['final_val_loss']:.4f}; gradient all-reduce "
            f"{z['grad_all_reduce_mb_per_step']:.3f} vs {dd['grad_all_reduce_mb_per_step']:.3f} MB/step, plus "
            f"{z['param_gather_mb_per_step']:.3f} MB/step parameter gather sent (ring wire "
            f"{ratio(z['wire_mb_per_step'], dd['wire_mb_per_step']):.2f}x DDP's); step "
            f"{z['s_per_step']:.3f} vs {dd['s_per_step']:.3f} s (load {z['load_avg']:.0f})"
        )
    headline.append(
        f"byte LM d={d}, {layers} layers, AdamW, {steps} steps, 4 sequences per worker; per-worker "
        "baseline, one process with 1 thread per worker, loopback"
    )
    return {"rows": rows, "headline": headline}
