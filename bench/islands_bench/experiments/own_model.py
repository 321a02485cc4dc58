"""own-model: models islands did not write, trained through the public API, against plain torch DDP.

A BatchNorm CNN on digits and a `transformers` GPT-2 built from a config, each trained by 4 gloo workers
with the user's own loop (islands.Stack hooks around forward, backward and the optimizer step):

    torch-ddp       torch's DistributedDataParallel alone, no islands (the baseline)
    ddp             islands.inner.DDP: the same exchange, counted
    powersgd        islands.inner.DDP(compressor=PowerSGD(rank=4)) (LIT-206)
    diloco          2 islands of 2: DDP inside, DiLoCo across (H inner steps, LIT-212)
    streaming       2 islands of 2: DDP inside, streaming DiLoCo across (2 fragments, tau 1, 4-bit, LIT-214)
    diloco-params   (cnn) DiLoCo with the buffer policy switched off: only parameters cross islands, as
                    every outer strategy did before, so the global model keeps its initial BatchNorm statistics

Every arm starts from the same weights, reads the same shards in the same order and takes the same number
of steps with the same AdamW and schedule. Bytes are the payload each worker handed to collectives
(islands' ledger); torch DDP's are the analytic equal, one fp32 gradient per step. The final loss is the
global model's (parameters and buffers) on fixed validation batches.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from islands_bench.harness import BenchContext, experiment
from islands_bench.spawn import run_module_ranks

WORKERS = 4
ARMS = {
    "cnn": ("torch-ddp", "ddp", "powersgd", "diloco", "streaming", "diloco-params"),
    "gpt2": ("torch-ddp", "ddp", "powersgd", "diloco", "streaming"),
}
# smoke: the reference arm, the BatchNorm path of DiLoCo (with and without statistics) on the CNN, and ours on
# GPT-2; PowerSGD and streaming run in their own experiments' smoke tiers
SMOKE_ARMS = {"cnn": ("torch-ddp", "diloco", "diloco-params"), "gpt2": ("torch-ddp", "ddp")}


def _settings(kind: str, quick: bool) -> dict:
    if kind == "cnn":
        return {
            "steps": 80 if quick else 200,
            "batch": 16,
            "lr": 3e-3,
            "inner_steps": 20 if quick else 50,
            "warmup": 10,
        }
    return {"steps": 40 if quick else 150, "batch": 8, "lr": 2e-3, "inner_steps": 10 if quick else 25, "warmup": 10}


def _worker(out_path: str, spec_json: str, rate: str) -> None:
    import time

    import torch
    from torch.nn.parallel import DistributedDataParallel

    import islands
    from islands.measure import describe, probe_interconnect
    from islands_bench.experiments.user_models import loss_of, make

    spec = json.loads(spec_json)
    torch.set_num_threads(1)
    arm, kind = spec["arm"], spec["model"]
    world = islands.init_world(islands=2 if arm in ("diloco", "streaming", "diloco-params") else 1)
    inter = probe_interconnect(world)
    model, batches, val, loss_fn = make(kind, world.rank, world.size, spec["batch"])
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    schedule = islands.WarmupCosine(spec["warmup"], spec["steps"])
    strategy = None
    if arm == "torch-ddp":
        model = DistributedDataParallel(model)
    else:
        outer = None
        if arm in ("diloco", "diloco-params"):
            outer = islands.outer.DiLoCo(inner_steps=spec["inner_steps"])
            if arm == "diloco-params":
                outer.buffer_policy = "none"  # the negative control: buffers never reach the global model
        elif arm == "streaming":
            outer = islands.outer.StreamingDiLoCo(spec["inner_steps"], schedule=islands.outer.Fragments(2, tau=1))
        inner = islands.inner.DDP(compressor=islands.compress.PowerSGD(rank=4) if arm == "powersgd" else None)
        strategy = islands.Stack(inner=inner, outer=outer)
        model = strategy.wrap(model, opt, world)
    times = []
    for step in range(spec["steps"]):
        for group in opt.param_groups:
            group["lr"] = spec["lr"] * schedule(step)
        batch = next(batches)
        t0 = time.perf_counter()
        loss_of(model, batch, loss_fn).backward()
        if strategy is not None:
            strategy.after_backward(model, step)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if strategy is not None:
            strategy.after_step(model, opt, step)
        times.append(time.perf_counter() - t0)
    if strategy is not None:
        strategy.finish(model)
        final = strategy.eval_model(model)
    else:
        final = model.module
    metrics = islands.evaluate(final, val, loss_fn, world.device)
    ledgers = world.all_gather_object(world.ledger.snapshot())
    grad_bytes = sum(p.numel() * p.element_size() for p in final.parameters())
    if world.rank == 0:
        sent = sum(led["total_sent"] for led in ledgers) / world.size
        across = sum(v for led in ledgers for k, v in led["sent"].items() if k.startswith("outer")) / world.size
        if arm == "torch-ddp":  # torch's all-reduce is not counted by islands: its payload is one gradient a step
            sent = across = grad_bytes * spec["steps"]
        Path(out_path).write_text(
            json.dumps(
                {
                    **metrics,
                    "mb_sent_per_worker": sent / 1e6,
                    "mb_across_islands_per_worker": across / 1e6,
                    "counted": arm != "torch-ddp",
                    "median_step_s": sorted(times)[len(times) // 2],
                    "parameters": sum(p.numel() for p in final.parameters()),
                    "interconnect": inter,
                    "interconnect_line": describe(inter),
                }
            )
        )
    islands.close_world(world)


def _rows(ctx: BenchContext, kind: str) -> list[dict]:
    settings = _settings(kind, ctx.quick)
    if ctx.smoke:
        settings.update(steps=4, inner_steps=2, warmup=1)
    rows = []
    for arm in SMOKE_ARMS[kind] if ctx.smoke else ARMS[kind]:
        ctx.log(f"{kind}: {arm} ({WORKERS} workers, {settings['steps']} steps)")
        spec = {"model": kind, "arm": arm, **settings}
        got = run_module_ranks(
            "islands_bench.experiments.own_model", [json.dumps(spec)], WORKERS, ctx.out_dir / f"{kind}-{arm}.json"
        )
        rows.append(
            {
                "model": kind,
                "arm": arm,
                "parameters": got["parameters"],
                "steps": settings["steps"],
                "inner_steps": settings["inner_steps"] if arm in ("diloco", "streaming", "diloco-params") else "",
                "final_val_loss": got["val_loss"],
                "val_accuracy": got.get("val_accuracy"),
                "mb_sent_per_worker": got["mb_sent_per_worker"],
                "mb_across_islands_per_worker": got["mb_across_islands_per_worker"],
                "bytes": "ledger" if got["counted"] else "analytic (1 fp32 gradient/step)",
                "median_step_ms": 1000 * got["median_step_s"],
                "interconnect": got["interconnect_line"],
            }
        )
    base = rows[0]
    for r in rows:
        r["loss_vs_torch_ddp_pct"] = 100 * (r["final_val_loss"] / base["final_val_loss"] - 1)
        r["bytes_vs_torch_ddp"] = r["mb_sent_per_worker"] / base["mb_sent_per_worker"]
        # across islands plain DDP sends everything it sends: every all-reduce crosses the island boundary
        across = (
            r["mb_across_islands_per_worker"]
            if r["arm"] in ("diloco", "streaming", "diloco-params")
            else r["mb_sent_per_worker"]
        )
        r["across_islands_x_fewer_than_torch_ddp"] = base["mb_sent_per_worker"] / max(across, 1e-12)
    return rows


def _headline(rows: list[dict]) -> list[str]:
    out = []
    for kind in dict.fromkeys(r["model"] for r in rows):
        mine = {r["arm"]: r for r in rows if r["model"] == kind}
        base = mine["torch-ddp"]
        parts = []
        for arm in (a for a in ("ddp", "powersgd", "diloco", "streaming") if a in mine):
            r = mine[arm]
            parts.append(
                f"{arm} loss {r['final_val_loss']:.3f} ({r['loss_vs_torch_ddp_pct']:+.1f}%), "
                f"{r['across_islands_x_fewer_than_torch_ddp']:.0f}x fewer bytes across islands"
                if arm in ("diloco", "streaming")
                else f"{arm} loss {r['final_val_loss']:.3f} ({r['loss_vs_torch_ddp_pct']:+.1f}%), "
                f"{r['bytes_vs_torch_ddp']:.3f}x torch DDP's bytes"
            )
        out.append(
            f"{kind} ({base['parameters']:,} parameters, {WORKERS} workers): torch DDP loss "
            f"{base['final_val_loss']:.3f}; " + "; ".join(parts)
        )
        if "diloco-params" in mine:
            with_b, without = mine["diloco"], mine["diloco-params"]
            out.append(
                f"{kind}: the global DiLoCo model with BatchNorm statistics averaged across islands reaches "
                f"validation accuracy {with_b['val_accuracy']:.3f} (loss {with_b['final_val_loss']:.3f}); "
                f"with parameters only, as before, {without['val_accuracy']:.3f} "
                f"(loss {without['final_val_loss']:.3f})"
            )
    return out


def _plot(result, path):
    from islands_bench.plots import figure

    with figure(path, 1, 2, figsize=(9, 4)) as (fig, axes):
        for ax, kind in zip(axes, ("cnn", "gpt2")):
            rows = [r for r in result["rows"] if r["model"] == kind]
            for r in rows:
                ax.scatter(
                    max(
                        r["mb_across_islands_per_worker"]
                        if r["arm"] in ("diloco", "streaming", "diloco-params")
                        else r["mb_sent_per_worker"],
                        1e-3,
                    ),
                    r["final_val_loss"],
                    label=r["arm"],
                )
            ax.set_xscale("log")
            ax.set_xlabel("MB per worker across islands (log)")
            ax.set_ylabel("final validation loss")
            ax.set_title(kind)
            ax.legend(fontsize=7)


@experiment(
    "own-model",
    practices=("SOTA-155", "SOTA-214", "SOTA-048"),
    help="a BatchNorm CNN and a transformers GPT-2 through the public API: DDP, PowerSGD, DiLoCo, streaming "
    "DiLoCo against plain torch DDP",
)
def own_model(ctx: BenchContext) -> dict:
    rows = _rows(ctx, "cnn")
    try:
        import transformers  # noqa: F401
    except ImportError:
        ctx.log("transformers is not installed: the GPT-2 rows are skipped (pip install islands[hf])")
    else:
        rows += _rows(ctx, "gpt2")
    for r in rows:
        r["final_val_loss"] = round(r["final_val_loss"], 4)
        if r.get("val_accuracy") is not None and not math.isnan(r["val_accuracy"]):
            r["val_accuracy"] = round(r["val_accuracy"], 4)
    return {
        "rows": rows,
        "headline": _headline(rows),
        "plot": _plot,
        "interconnect": sorted({r["interconnect"] for r in rows}),
        "baseline": [
            f"the same model, data order, AdamW and schedule under torch's DistributedDataParallel alone, "
            f"{WORKERS} processes with 1 thread each on gloo, same run; bytes: payload per worker"
        ],
    }


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])
