"""memory-savers (SOTA-249, SOTA-118, SOTA-031): what activation checkpointing and bf16 save, what they cost,
and whether the sizer turns the saving into throughput.

Bytes are exact and load-independent: the peak of bytes autograd holds for backward
(islands.memory.accounting), plus parameters, gradients and AdamW moments. Step times are medians of
repetitions interleaved across variants in one process, so a burst on the shared machine hits every variant
alike. Losses come from short in-process training runs of the default LM, one per variant, same data order.
"""

from __future__ import annotations

import statistics
import time

import torch

from islands.memory import (
    ForwardBackward,
    activation_peak,
    plan_micro_batch,
    sqrt_segments,
    state_bytes,
    synthetic_batches,
)
from islands.models import ByteTransformer, sequence_loss
from islands_bench.harness import BenchContext, experiment

VARIANTS = {  # name: (checkpoint segments per layer count -> int, precision)
    "fp32": (lambda n: 0, "fp32"),
    "checkpoint": (lambda n: n, "fp32"),  # one segment per block
    "bf16": (lambda n: 0, "bf16"),
    "checkpoint+bf16": (lambda n: n, "bf16"),
}
MB = 1e6


def _model(layers: int, context: int, d_model: int = 128, segments: int = 0) -> ByteTransformer:
    torch.manual_seed(0)
    m = ByteTransformer(d_model=d_model, n_layers=layers, n_heads=4, context=context)
    m.set_activation_checkpointing(segments)
    return m


def _timed_steps(setups: dict, reps: int) -> dict[str, float]:
    """Median CPU ms per full step (forward, backward, AdamW step) for each setup, repetitions interleaved.

    Process CPU time, not wall time: with one torch thread it is the step's own work, which other
    processes on a shared machine stretch far less than they stretch the wall clock."""
    times: dict[str, list[float]] = {name: [] for name in setups}
    names = list(setups)
    for rep in range(reps + 1):  # repetition 0 warms every variant up
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            model, opt, step, x, y = setups[name]
            t = time.process_time()
            step(model, (x, y), sequence_loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if rep:
                times[name].append(time.process_time() - t)
    return {name: 1000 * statistics.median(v) for name, v in times.items()}


def _savings(ctx: BenchContext, settings, reps: int) -> list[dict]:
    rows = []
    for context, batch in settings:
        make = synthetic_batches("lm", context)
        x, y = make(batch)
        setups, held = {}, {}
        for name, (segments, precision) in VARIANTS.items():
            model = _model(4, context, segments=segments(4))
            step = ForwardBackward(precision=precision)
            held[name] = activation_peak(model, sequence_loss, make, batch, step)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            setups[name] = (model, opt, step, x, y)
        ctx.log(f"context {context}: timing {len(setups)} variants x {reps} interleaved steps")
        ms = _timed_steps(setups, reps)
        for name, (model, opt, _, _, _) in setups.items():
            rows.append(
                {
                    "part": "savings",
                    "context": context,
                    "layers": 4,
                    "batch_per_worker": batch,
                    "tokens_per_worker": batch * context,
                    "variant": name,
                    "held_activation_mb": round(held[name] / MB, 3),
                    "held_vs_fp32": round(held[name] / held["fp32"], 3),
                    "state_mb": round(state_bytes(model, opt).total / MB, 3),
                    "step_cpu_ms": round(ms[name], 1),
                    "step_time_vs_fp32": round(ms[name] / ms["fp32"], 3),
                }
            )
    return rows


def _depth(layer_counts, context: int, batch: int) -> list[dict]:
    """SOTA-249's sqrt(n) segments against one segment per block, as depth grows (bytes only)."""
    rows = []
    make = synthetic_batches("lm", context)
    step = ForwardBackward()
    for n in layer_counts:
        held = {
            k: activation_peak(_model(n, context, d_model=64, segments=s), sequence_loss, make, batch, step)
            for k, s in (("none", 0), ("sqrt(n) segments", sqrt_segments(n)), ("per block", n))
        }
        for k, v in held.items():
            rows.append(
                {
                    "part": "depth",
                    "context": context,
                    "layers": n,
                    "batch_per_worker": batch,
                    "variant": k,
                    "held_activation_mb": round(v / MB, 3),
                    "held_vs_fp32": round(v / held["none"], 3),
                }
            )
    return rows


def _losses(ctx: BenchContext, steps: int, batch: int, variants) -> list[dict]:
    from islands import World
    from islands.app.build import run_job
    from islands.app.validate import validate
    from islands.config import from_mapping

    rows = []
    for name in variants:
        segments, precision = VARIANTS[name]
        cfg = validate(
            from_mapping(
                {
                    "steps": steps,
                    "workers": 1,
                    "global_batch": batch,
                    "warmup": min(30, steps // 5),
                    "eval_every": 0,
                    "eval_batches": 8,
                    "probe": False,
                    "progress": False,
                    "precision": precision,
                    "activation_checkpointing": bool(segments(4)),
                }
            )
        )
        ctx.log(f"training {name} for {steps} steps")
        record = run_job(cfg, World.single())
        s = record["summary"]
        rows.append(
            {
                "part": "loss",
                "context": 128,
                "layers": 4,
                "batch_per_worker": batch,
                "variant": name,
                "steps": steps,
                "final_val_loss": round(s["final_val_loss"], 4),
                "median_step_ms": round(1000 * s["median_seconds_per_step"], 1),
            }
        )
    base = rows[0]["final_val_loss"]
    for r in rows:
        r["loss_gap_vs_fp32"] = round(r["final_val_loss"] - base, 4)
    return rows


def _sizer(ctx: BenchContext, batch: int, fp32_fits: int, reps: int) -> list[dict]:
    """One budget for all: what fp32 needs for `fp32_fits` samples. Each variant's sizer picks its micro-batch;
    then whole steps of `batch` samples (accumulating) are timed side by side, with fp32 at every size too."""
    make = synthetic_batches("lm", 128)
    x, y = make(batch)
    probe = _model(4, 128)
    state = state_bytes(probe, torch.optim.AdamW(probe.parameters()))  # the same AdamW state every plan counts
    budget = state.total + activation_peak(probe, sequence_loss, make, fp32_fits, ForwardBackward())
    setups, picked = {}, {}
    for name, (segments, precision) in VARIANTS.items():
        model = _model(4, 128, segments=segments(4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        plan = plan_micro_batch(model, sequence_loss, make, batch, budget, opt, precision)
        picked[name] = plan
        setups[name] = (model, opt, ForwardBackward(plan.micro_batch, precision), x, y)
    sizes = sorted({1, 2, 4, 8, 16, 32} & set(range(1, batch + 1)) | {picked["fp32"].micro_batch})
    for m in sizes:  # the claim's premise: throughput against micro-batch size, memory aside
        model = _model(4, 128)
        setups[f"fp32 micro={m}"] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), ForwardBackward(m), x, y)
    ctx.log(f"sizer: budget {budget / MB:.2f} MB; timing {len(setups)} setups x {reps} steps of {batch} samples")
    ms = _timed_steps(setups, reps)
    rows = []
    for name, t in ms.items():
        plan = picked.get(name)
        micro = plan.micro_batch if plan else int(name.split("=")[1])
        rows.append(
            {
                "part": "sizer" if plan else "micro-batch curve",
                "context": 128,
                "layers": 4,
                "batch_per_worker": batch,
                "variant": name if plan else "fp32",
                "budget_mb": round(budget / MB, 3) if plan else "",
                "micro_batch": micro,
                "planned_total_mb": round(plan.total_bytes / MB, 3) if plan else "",
                "step_cpu_ms": round(t, 1),
                "samples_per_cpu_s": round(batch / (t / 1000), 1),
            }
        )
    return rows


@experiment(
    "memory-savers",
    practices=("SOTA-249", "SOTA-118", "SOTA-031"),
    help="Held activation bytes, step time and loss for checkpointing and bf16; micro-batch the sizer picks "
    "under one budget, and the throughput it buys",
)
def memory_savers(ctx: BenchContext) -> dict:
    quick = ctx.quick
    torch.set_num_threads(1)  # one thread per worker, the baseline; more threads spin and inflate CPU time
    # bf16 matmuls run ~10x slower than fp32 on a CPU without bf16 instructions (AVX2 only here), so the
    # quick run keeps samples few; bytes scale linearly in batch, so the ratios are unaffected.
    reps = 1 if ctx.smoke else 2 if quick else 7
    rows = _savings(ctx, ((128, 1), (512, 1)) if ctx.smoke else ((128, 8), (512, 2) if quick else (512, 8)), reps=reps)
    rows += _depth((4, 16) if quick else (4, 9, 16, 25), context=128, batch=4)
    rows += _losses(
        ctx,
        2 if ctx.smoke else 40 if quick else 300,
        batch=4 if quick else 8,
        variants=("fp32", "checkpoint", "bf16") if quick else tuple(VARIANTS),
    )
    rows += _sizer(ctx, batch=4 if ctx.smoke else 16 if quick else 32, fp32_fits=4 if quick else 8, reps=reps)
    return {
        "rows": rows,
        "headline": _headline(rows),
        "interconnect": ["none: one process, no communication"],
        "baseline": [
            "per worker: one process, 1 torch thread, CPU; bytes exact (saved-tensor hooks), "
            "times are medians of interleaved steps"
        ],
    }


def _headline(rows: list[dict]) -> list[str]:
    def pick(part, **kw):
        return [r for r in rows if r["part"] == part and all(r.get(k) == v for k, v in kw.items())]

    out = []
    for context in (128, 512):
        s = {r["variant"]: r for r in pick("savings", context=context)}
        out.append(
            f"context {context}, 4 layers, {s['fp32']['batch_per_worker']} samples "
            f"({s['fp32']['tokens_per_worker']} tokens)/worker: activations held fp32 "
            f"{s['fp32']['held_activation_mb']} MB; checkpointing x{s['checkpoint']['held_vs_fp32']} "
            f"at x{s['checkpoint']['step_time_vs_fp32']} step time; bf16 x{s['bf16']['held_vs_fp32']} "
            f"at x{s['bf16']['step_time_vs_fp32']}; both x{s['checkpoint+bf16']['held_vs_fp32']} "
            f"at x{s['checkpoint+bf16']['step_time_vs_fp32']}."
        )
    deep = max(r["layers"] for r in pick("depth"))
    d = {r["variant"]: r for r in pick("depth", layers=deep)}
    out.append(
        f"{deep} layers: sqrt(n) segments hold x{d['sqrt(n) segments']['held_vs_fp32']} of no checkpointing, "
        f"one segment per block x{d['per block']['held_vs_fp32']} (SOTA-249's sqrt(n) assumes a layer holds "
        f"no more than its input; a transformer block holds far more)."
    )
    loss = {r["variant"]: r for r in pick("loss")}
    gaps = ", ".join(f"{k} {v['loss_gap_vs_fp32']:+}" for k, v in loss.items() if k != "fp32")
    out.append(
        f"after {loss['fp32']['steps']} steps of {loss['fp32']['batch_per_worker']} samples, val loss fp32 "
        f"{loss['fp32']['final_val_loss']}; gaps: {gaps}."
    )
    sz = {r["variant"]: r for r in pick("sizer")}
    base = sz["fp32"]
    parts = [
        f"{k} micro-batch {v['micro_batch']} at x{round(v['samples_per_cpu_s'] / base['samples_per_cpu_s'], 3)} "
        f"samples/s"
        for k, v in sz.items()
        if k != "fp32"
    ]
    out.append(
        f"one budget ({base['budget_mb']} MB, fp32 fits micro-batch {base['micro_batch']}): "
        + "; ".join(parts)
        + " (SOTA-031 holds where the ratio exceeds 1)."
    )
    curve = pick("micro-batch curve")
    out.append(
        "fp32 samples per CPU second by micro-batch: "
        + ", ".join(f"{r['micro_batch']}: {r['samples_per_cpu_s']}" for r in curve)
        + "."
    )
    return out
