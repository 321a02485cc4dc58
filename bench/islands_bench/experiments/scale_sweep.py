"""scale-sweep: DiLoCo and streaming DiLoCo against DDP at equal tokens, over model sizes (issue #18 item 6).

Three sizes of the byte-level LM spanning >= 16x parameters (full: 0.51M, 2.8M and 10.9M; quick: 8.4k, 43k and
135k), each trained three ways on the same token budget, tokens per parameter fixed (full: 20, the usual
compute-optimal rule of thumb of Hoffmann et al. 2022; quick: 4, so the tiny sizes finish in minutes):
  ddp        one model on the global batch every step: what synchronous DDP over M workers computes (the
             gradient of the mean loss over M x b samples), with the bytes a DDP rank would send counted as
             one fp32 gradient all-reduce per step
  diloco     M islands, H inner AdamW steps, then the outer step on the mean delta (SOTA-155, LIT-212)
  streaming  streaming DiLoCo: F=4 fragments in turn, each exchange overlapping tau=1 step, 4-bit deltas (LIT-214)
The islands run in ONE process through islands.simulate (the real strategy code; two simulated islands give a
two-process gloo run's parameters bit for bit, docs/simulate.md), so the largest size fits one GPU and the sweep
needs no network; bytes are what the ledger counts, no link is emulated. Equal tokens: every arm takes the same
number of steps with M x b samples per step in all. The outer step everywhere is the setting diloco-vs-ddp found
best (plain SGD, lr 1 x sqrt(M)). The question (SOTA-155): does DiLoCo's gap to DDP stay put, shrink or grow as
the model grows, at a fixed ratio of data to parameters?

Every arm trains through the Trainer's `compile=islands.Compile(...)` with ForwardBackward(precision="auto"): on
CUDA inductor and bf16 autocast (issue #34 item 6: the GPU sweep compiled, in bf16); on the CPU aot_eager (it traces
the same forward and backward graphs but generates no code, so a CPU needs no C++ compiler and the smoke tier keeps
the compiled path's wiring checked for a few seconds of tracing) in fp32. Every row names the device, the compile
backend and the precision its arm ran with, and the compile's seconds (COMPILE_SECONDS_DEFINITION).

Arms run in order of what a cut run should already hold (ARM_ORDER): DDP and DiLoCo of every size, smallest first,
then the streaming arms; each finished pair's gap goes to the log at once. A run cut by its time box keeps the
finished arms (runs/*.json) and the cut arm's snapshots (every SNAPSHOT_ROUNDS rounds), and `--reuse` resumes from
there (scripts/gpu-check's `sweep` step, docs/gpu.md).

--quick: tiny sizes, 4 tokens per parameter, 2 islands, H=20 (10 rounds in 200 steps), on the CPU: a few
minutes, a smoke test of the sweep, not a measurement of scale. Full: 4 islands, H=100, 2000 steps, meant for
`--device cuda` (one GPU; on the CPU every arm runs with one intra-op thread, see _arm).
"""

from __future__ import annotations

import copy
import json
import shutil

import torch

import islands
from islands.memory import ForwardBackward, resolve_precision
from islands.models import count_parameters
from islands.outer import DiLoCo, StreamingDiLoCo
from islands.tasks import lm_task
from islands_bench.experiments.arm_snapshots import ArmSnapshots
from islands_bench.experiments.outer_common import gap_pct
from islands_bench.harness import BenchContext, experiment

FULL = dict(
    sizes=((96, 4, 4), (192, 6, 6), (384, 6, 6)),
    context=128,
    islands=4,
    steps=2000,
    H=100,
    tokens_per_param=20.0,
    lr=3e-3,
)
QUICK = dict(
    sizes=((12, 1, 2), (32, 2, 2), (64, 2, 4)), context=32, islands=2, steps=200, H=20, tokens_per_param=4.0, lr=3e-3
)
# an arm's state is kept every 2 rounds (arm_snapshots): --reuse resumes a cut arm from there, so a time box that cuts
# an arm loses at most 2 of its 20 full-tier rounds (200 steps); 4 islands' 10.9M-parameter states are ~0.7 GB a set
SNAPSHOT_ROUNDS = 2
FRAGMENTS, TAU, BITS = 4, 1, 4  # streaming DiLoCo's setting in LIT-214
OUTER = dict(outer="sgd", outer_lr=1.0, momentum=0.0, lr_scale="sqrt-islands")  # diloco-vs-ddp's best (SCALED)
ARMS = ("ddp", "diloco", "streaming")
ARM_ORDER = (("ddp", "diloco"), ("streaming",))  # run in this order, sizes smallest first within each group
# torch.compile's backend per device: inductor on CUDA; aot_eager on the CPU (no C++ compiler needed, and no codegen
# for a tiny model that tracing already makes slower to start); None would run eagerly
COMPILE_BACKEND = {"cuda": "inductor", "cpu": "aot_eager"}
PRECISION = "auto"  # ForwardBackward's: bf16 autocast on a CUDA device with bf16, fp32 elsewhere
WARMUP_FRACTION, WEIGHT_DECAY, GRAD_CLIP, BETAS = 0.1, 0.1, 1.0, (0.9, 0.95)  # the built-in tasks' defaults
EVAL_BATCHES = 8


def _batch_per_island(params: int, tier: dict) -> int:
    """Samples per island per step so that steps x islands x batch x context = tokens_per_param x params."""
    per_step = tier["steps"] * tier["islands"] * tier["context"]
    return max(1, round(tier["tokens_per_param"] * params / per_step))


def _strategy(arm: str, h: int):
    if arm == "diloco":
        return islands.Stack(outer=DiLoCo.from_options(inner_steps=h, **OUTER))
    if arm == "streaming":
        return islands.Stack(
            outer=StreamingDiLoCo.from_options(inner_steps=h, fragments=FRAGMENTS, tau=TAU, bits=BITS, **OUTER)
        )
    return islands.Stack()


def compile_backend(device: str) -> str | None:
    """The torch.compile backend the sweep's arms use on `device` ("cpu" or "cuda")."""
    return COMPILE_BACKEND.get(device)


def _fit(
    task,
    world,
    arm: str,
    tier: dict,
    snapshots: ArmSnapshots | None = None,
    callbacks=(),
    compile_backend: str | None = None,
) -> dict:
    """Train one island (or the DDP model) with the Trainer, compiled with `compile_backend` (None: eager), from the
    arm's last snapshot when resuming; the global model's validation loss on rank 0, and what the fit ran as: its
    precision and its compile record (backend, seconds, graphs; None when eager)."""
    model = copy.deepcopy(task.model)  # every island starts from the same weights
    opt = torch.optim.AdamW(model.parameters(), lr=tier["lr"], betas=BETAS, weight_decay=WEIGHT_DECAY)
    steps = tier["steps"]
    saving = [snapshots.callback(world.rank)] if snapshots is not None else []
    trainer = islands.Trainer(
        model=model,
        optimizer=opt,
        loss_fn=task.loss_fn,
        train_data=task.train_data,
        world=world,
        strategy=_strategy(arm, tier["H"]),
        callbacks=[*saving, *callbacks],
        grad_clip=GRAD_CLIP,
        schedule=islands.WarmupCosine(max(1, int(steps * WARMUP_FRACTION)), steps),
        step_fn=ForwardBackward(precision=PRECISION),
        batch_size=task.batch_size,
        compile=islands.Compile(backend=compile_backend) if compile_backend else None,
    )
    if snapshots is not None:
        snapshots.restore(trainer, world.rank)
    trainer.fit(steps)
    out = {
        "ledger": world.ledger.snapshot(),
        "train_loss": trainer.series["train"][-1]["loss"],
        "precision": resolve_precision(PRECISION, world.device),
        "compile": trainer.record_parts().get("compile"),
    }
    if world.rank == 0:
        out.update(islands.evaluate(trainer.eval_model, task.val_data, task.loss_fn, world.device))
    return out


def _arm(ctx: BenchContext, label: str, spec: dict, device: str) -> dict:
    """One arm, or its stored result under --reuse when the stored spec is the same."""
    path = ctx.out_dir / "runs" / f"{label}.json"
    if ctx.reuse and path.is_file():
        stored = json.loads(path.read_text())
        if stored.get("spec") == spec:
            ctx.log(f"run {label}: reusing {path} (same spec; --reuse)")
            ctx.log(ctx.progress.reused(label))
            return stored["result"]
    d, n_layers, heads = spec["size"]
    tier = spec["tier"]
    m = tier["islands"] if spec["arm"] != "ddp" else 1
    batch = spec["batch"] * (tier["islands"] if spec["arm"] == "ddp" else 1)  # DDP: the global batch at once
    with ctx.arm(label):
        task = lm_task(
            d_model=d,
            n_layers=n_layers,
            n_heads=heads,
            context=tier["context"],
            batch_size=batch,
            eval_batches=EVAL_BATCHES,
            seed=0,
        )
        snapshots = ArmSnapshots(ctx.out_dir / "runs" / f"{label}.snapshots", SNAPSHOT_ROUNDS * tier["H"], m, spec)
        at = snapshots.prepare(ctx.reuse)
        if at is not None:
            ctx.log(f"run {label}: resuming at step {at} of {tier['steps']} from {snapshots.root} (--reuse)")
        if spec["compile"]:  # every arm compiles afresh, static shapes: not the graphs (made dynamic by the shape
            torch._dynamo.reset()  # changes) of the arms before it in this process, so a resumed arm runs the same
        threads = torch.get_num_threads()
        if device == "cpu":  # every arm alike; on a shared CPU, 2 intra-op threads ran DDP ~40x slower (spinning)
            torch.set_num_threads(1)
        try:  # DDP too runs as a simulation (of one island): the same thread setup for every arm
            results = islands.simulate.run(
                lambda w: _fit(task, w, spec["arm"], tier, snapshots, compile_backend=spec["compile"]),
                islands=m,
                device=device,
            )
        finally:
            torch.set_num_threads(threads)
        wall = snapshots.wall_s()  # earlier sessions' part of a resumed arm included
    ledger = results[0]["ledger"]
    # the islands share the process's compiled graphs: whichever island steps first compiles them (its record has
    # the seconds and graphs), the others reuse them, so the arm's compile is the largest of the islands' records
    compiled = [r["compile"] for r in results if r["compile"] is not None]
    compile_s = [c["seconds"] for c in compiled if c["seconds"] is not None]
    result = {
        "val_loss": results[0]["val_loss"],
        "train_loss": results[0]["train_loss"],
        "wall_s": wall,
        "precision": results[0]["precision"],
        "compile": spec["compile"],
        # the compile seconds of the session that finished the arm (a resumed arm compiles again)
        "compile_s": round(max(compile_s), 2) if compile_s else None,
        "graphs": max(c["graphs"] or 0 for c in compiled) if compiled else None,
        "sent": ledger["total_sent"],
        "calls": ledger["calls"],
        "sent_by_kind": ledger["sent"],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"spec": spec, "result": result}, indent=1))
    shutil.rmtree(snapshots.root, ignore_errors=True)  # the arm is done: its result is what --reuse reads now
    return result


def device_name(device: str) -> str:
    """What the rows call the device: the GPU's name on CUDA, "cpu" otherwise."""
    return torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else device


@experiment(
    "scale-sweep",
    practices=("SOTA-155",),
    devices=("cpu", "cuda"),
    help="DiLoCo (H=100) and streaming DiLoCo (F=4, 4-bit) vs DDP at equal tokens for three model sizes "
    "spanning >= 16x parameters, tokens per parameter fixed; islands simulated in one process",
)
def scale_sweep(ctx: BenchContext) -> dict:
    tier = dict(QUICK if ctx.quick else FULL)
    if ctx.smoke:  # the smallest size, two rounds
        tier.update(sizes=QUICK["sizes"][:1], steps=2 * QUICK["H"])
    device = ctx.device
    backend = compile_backend(device)
    ctx.plan(len(tier["sizes"]) * len(ARMS))
    shapes = []  # (size, params, batch per island, tokens) per size, smallest first
    for size in tier["sizes"]:
        d, n_layers, heads = size
        params = count_parameters(
            lm_task(
                d_model=d, n_layers=n_layers, n_heads=heads, context=tier["context"], batch_size=1, eval_batches=1
            ).model
        )
        batch = _batch_per_island(params, tier)
        shapes.append((size, params, batch, tier["steps"] * tier["islands"] * batch * tier["context"]))
    by_size: dict[int, dict] = {params: {} for _, params, _, _ in shapes}
    for group in ARM_ORDER:  # DDP and DiLoCo of every size first: what a run cut by its time box should hold
        for size, params, batch, _ in shapes:
            for arm in group:
                spec = {
                    "size": list(size),
                    "arm": arm,
                    "batch": batch,
                    "device": device,
                    "compile": backend,
                    "precision": PRECISION,
                    "tier": {k: (list(map(list, v)) if k == "sizes" else v) for k, v in tier.items()},
                }
                by_size[params][arm] = _arm(ctx, f"{params}-{arm}", spec, device)
            done = by_size[params]
            for arm in group:  # in the log at once: a run cut later still shows the pairs it finished
                if arm != "ddp":
                    gap = gap_pct(done[arm]["val_loss"], done["ddp"]["val_loss"])
                    ctx.log(f"{params:,} parameters: {arm} {gap:+.2f}% final val loss against DDP at equal tokens")
    gpu = device_name(device)
    rows = []
    for size, params, batch, tokens in shapes:
        d, n_layers, _ = size
        by_arm = by_size[params]
        ddp_bytes = tier["steps"] * 4 * params  # one fp32 gradient all-reduce per step (payload, not wire)
        for arm in ARMS:
            r = by_arm[arm]
            sent = ddp_bytes if arm == "ddp" else r["sent"]
            syncs = tier["steps"] if arm == "ddp" else r["calls"].get("outer_delta", 0)
            rows.append(
                {
                    "params": params,
                    "d_model": d,
                    "n_layers": n_layers,
                    "arm": arm,
                    "islands": 1 if arm == "ddp" else tier["islands"],
                    "batch_per_island": batch,
                    "tokens": tokens,
                    "tokens_per_param": round(tokens / params, 2),
                    "final_val_loss": r["val_loss"],
                    "gap_vs_ddp_pct": gap_pct(r["val_loss"], by_arm["ddp"]["val_loss"]),
                    "bytes_per_worker": sent,
                    "bytes_cut_vs_ddp": ddp_bytes / max(sent, 1),
                    "peak_bytes_per_sync": sent / max(syncs, 1),
                    "wall_s": round(r["wall_s"], 1),
                    "device": gpu,
                    "compiled": r["compile"] or "no",
                    "precision": r["precision"],
                    "compile_s": r["compile_s"],
                }
            )
    sizes = sorted({r["params"] for r in rows})
    gaps = {
        arm: [next(r["gap_vs_ddp_pct"] for r in rows if r["params"] == p and r["arm"] == arm) for p in sizes]
        for arm in ("diloco", "streaming")
    }
    trend = {arm: ("shrinks" if g[-1] < g[0] else "grows") for arm, g in gaps.items()}
    precisions = sorted({r["precision"] for r in rows})
    how = f"torch.compile {backend}" if backend else "eager"
    where = (
        f"{gpu} ({device}), {how}, {'/'.join(precisions)}, islands simulated in one process (islands.simulate; "
        "no link: bytes are ledger payload)"
    )
    headline = [
        f"{'quick tier (tiny sizes, a smoke test of the sweep, not a scale measurement): ' if ctx.quick else ''}"
        f"byte-level LM on Python's stdlib source, sizes {', '.join(f'{p:,}' for p in sizes)} parameters "
        f"({sizes[-1] / sizes[0]:.0f}x), {tier['tokens_per_param']:g} tokens/param (rounded batches: "
        f"{', '.join(str(r['tokens_per_param']) for r in rows if r['arm'] == 'ddp')}), {tier['islands']} islands, "
        f"{tier['steps']} steps, H={tier['H']}",
        "final val loss gap to DDP at equal tokens, smallest -> largest: DiLoCo "
        + " -> ".join(f"{g:+.2f}%" for g in gaps["diloco"])
        + f" ({trend['diloco']}); streaming DiLoCo F={FRAGMENTS} "
        f"{BITS}-bit " + " -> ".join(f"{g:+.2f}%" for g in gaps["streaming"]) + f" ({trend['streaming']})",
        "bytes per worker vs DDP's per-step fp32 gradient all-reduce: DiLoCo "
        + ", ".join(f"{r['bytes_cut_vs_ddp']:.0f}x" for r in rows if r["arm"] == "diloco")
        + "; streaming "
        + ", ".join(f"{r['bytes_cut_vs_ddp']:.0f}x" for r in rows if r["arm"] == "streaming"),
        f"where: {where}; outer step sgd lr sqrt(M) (diloco-vs-ddp's best); DDP = one model on the global batch",
    ]
    return {
        "rows": rows,
        "headline": headline,
        "device": gpu,
        "compile": backend,
        "precision": precisions,
        "interconnect": [where],
        "baseline": ["DDP at equal tokens: one model on M x b samples per step (synchronous data parallelism)"],
    }
