"""Shared pieces of the sharding experiments (no experiment is registered here).

Every run trains the byte-level LM with log_every=1, so the per-step times come from the run record;
the reported step time is the median over steps after the first (the first carries FSDP's lazy
initialisation and the allocator's warm-up). Bytes come from rank 0's ledger (ranks are symmetric up to
one pad row), without the evaluation gathers, per step. Wire bytes apply ring-algorithm factors:
all-gather and reduce-scatter move (n-1)/n of the whole tensor per rank, an all-reduce 2(n-1)/n.
Per-rank memory is parameters + gradients + AdamW's two slots, as laid out by FSDP
(islands.sync.state_bytes_per_rank; tests/integration/sharding/test_sharded.py checks it against the local shards).
"""

from __future__ import annotations

import itertools
import os
import statistics

from islands.models import ByteTransformer
from islands.sync import parse_wrap, plan_units, state_bytes_per_rank
from islands_bench.harness import BenchContext

TRAINING_KINDS = ("grad_all_reduce", "fsdp_all_gather", "fsdp_reduce_scatter", "fsdp_grad_norm")


def lm_config(d_model: int, n_layers: int, steps: int, workers: int, **more) -> dict:
    heads = max(1, d_model // 64)
    return dict(
        task="lm",
        d_model=d_model,
        n_layers=n_layers,
        n_heads=heads,
        context=64,
        global_batch=4 * workers,
        steps=steps,
        warmup=1,
        eval_every=0,
        eval_batches=1,
        log_every=1,
        workers=workers,
        **more,
    )


def model_units(cfg: dict, wrap: str):
    torch_model = ByteTransformer(cfg["d_model"], cfg["n_layers"], cfg["n_heads"], cfg["context"])
    return plan_units(torch_model, parse_wrap(wrap))[1]


def median_step_seconds(rec: dict) -> float:
    t = [0.0] + [p["elapsed"] for p in rec["series"]["train"]]
    steps = [b - a for a, b in itertools.pairwise(t)][1:]  # drop the first step
    return statistics.median(steps) if steps else rec["summary"]["seconds_per_step"]


def bytes_per_step(rec: dict) -> tuple[float, float]:
    """(payload bytes handed to collectives, ring wire bytes) per step on rank 0, training traffic only."""
    ledger, n = rec["comm"]["per_rank"][0], rec["world"]["size"] // rec["world"]["islands"]
    steps = rec["summary"]["steps"]
    sent = ledger["sent"]
    payload = sum(sent.get(k, 0) for k in TRAINING_KINDS)
    ring = (n - 1) / n
    wire = (
        ledger["received"].get("fsdp_all_gather", 0)
        + ring * sent.get("fsdp_reduce_scatter", 0)
        + 2 * ring * (sent.get("grad_all_reduce", 0) + sent.get("fsdp_grad_norm", 0))
    )
    return payload / steps, wire / steps


def run_row(ctx: BenchContext, label: str, cfg: dict, testbed: str = "") -> dict:
    """Train one configuration and return its measured row."""
    load_before = os.getloadavg()[0]
    rec = ctx.train(label, **cfg, **({"testbed": testbed} if testbed else {}))
    n = cfg["workers"]
    fsdp = cfg.get("inner") == "fsdp"
    units = model_units(cfg, cfg.get("wrap", "block") if fsdp else "model")
    memory = state_bytes_per_rank(units, n if fsdp else 1)["total"]
    payload, wire = bytes_per_step(rec)
    return {
        "run": label,
        "strategy": "fsdp" if fsdp else "ddp",
        "wrap": cfg.get("wrap", "-") if fsdp else "-",
        "reshard": cfg.get("reshard", True) if fsdp else "-",
        "workers": n,
        "d_model": cfg["d_model"],
        "params": sum(u.numel() for u in units),
        "units": len(units) if fsdp else 0,
        "state_mb_per_rank": memory / 1e6,
        "s_per_step": median_step_seconds(rec),
        "payload_mb_per_step": payload / 1e6,
        "wire_mb_per_step": wire / 1e6,
        "final_val_loss": rec["summary"]["final_val_loss"],
        "load_avg": load_before,
        "interconnect": rec["interconnect_line"],
    }


def best_of_two_passes(ctx: BenchContext, configs: list[tuple[str, dict]]) -> list[dict]:
    """Run every configuration twice, the second pass in reverse order, and keep each one's faster pass.

    Load from other jobs on a shared machine drifts over minutes; a reversed second pass spreads that drift
    over all configurations instead of favouring the ones that ran first.
    """
    rows: dict[str, dict] = {}
    for order in (configs,) if ctx.smoke else (configs, configs[::-1]):  # smoke: one pass
        for label, cfg in order:
            r = run_row(ctx, label if label not in rows else f"{label}-again", cfg)
            r["run"] = label
            passes = rows[label]["s_per_step_passes"] + [r["s_per_step"]] if label in rows else [r["s_per_step"]]
            if label not in rows or r["s_per_step"] < rows[label]["s_per_step"]:
                rows[label] = r
            rows[label]["s_per_step_passes"] = passes
    return [rows[label] for label, _ in configs]


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")
