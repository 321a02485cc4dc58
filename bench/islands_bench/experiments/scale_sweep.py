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
from islands.memory import ForwardBackward
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
SNAPSHOT_ROUNDS = 5  # an arm's state is kept every 5 rounds (arm_snapshots): --reuse resumes a cut arm from there
FRAGMENTS, TAU, BITS = 4, 1, 4  # streaming DiLoCo's setting in LIT-214
OUTER = dict(outer="sgd", outer_lr=1.0, momentum=0.0, lr_scale="sqrt-islands")  # diloco-vs-ddp's best (SCALED)
ARMS = ("ddp", "diloco", "streaming")
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


def _fit(task, world, arm: str, tier: dict, snapshots: ArmSnapshots | None = None, callbacks=()) -> dict:
    """Train one island (or the DDP model) with the Trainer, from the arm's last snapshot when resuming; the
    global model's validation loss on rank 0."""
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
        step_fn=ForwardBackward(precision="auto"),
        batch_size=task.batch_size,
    )
    if snapshots is not None:
        snapshots.restore(trainer, world.rank)
    trainer.fit(steps)
    out = {"ledger": world.ledger.snapshot(), "train_loss": trainer.series["train"][-1]["loss"]}
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
        threads = torch.get_num_threads()
        if device == "cpu":  # every arm alike; on a shared CPU, 2 intra-op threads ran DDP ~40x slower (spinning)
            torch.set_num_threads(1)
        try:  # DDP too runs as a simulation (of one island): the same thread setup for every arm
            results = islands.simulate.run(
                lambda w: _fit(task, w, spec["arm"], tier, snapshots), islands=m, device=device
            )
        finally:
            torch.set_num_threads(threads)
        wall = snapshots.wall_s()  # earlier sessions' part of a resumed arm included
    ledger = results[0]["ledger"]
    result = {
        "val_loss": results[0]["val_loss"],
        "train_loss": results[0]["train_loss"],
        "wall_s": wall,
        "sent": ledger["total_sent"],
        "calls": ledger["calls"],
        "sent_by_kind": ledger["sent"],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"spec": spec, "result": result}, indent=1))
    shutil.rmtree(snapshots.root, ignore_errors=True)  # the arm is done: its result is what --reuse reads now
    return result


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
    ctx.plan(len(tier["sizes"]) * len(ARMS))
    rows = []
    for size in tier["sizes"]:
        d, n_layers, heads = size
        params = count_parameters(
            lm_task(
                d_model=d, n_layers=n_layers, n_heads=heads, context=tier["context"], batch_size=1, eval_batches=1
            ).model
        )
        batch = _batch_per_island(params, tier)
        tokens = tier["steps"] * tier["islands"] * batch * tier["context"]
        by_arm = {}
        for arm in ARMS:
            spec = {
                "size": list(size),
                "arm": arm,
                "batch": batch,
                "device": device,
                "tier": {k: (list(map(list, v)) if k == "sizes" else v) for k, v in tier.items()},
            }
            by_arm[arm] = _arm(ctx, f"{params}-{arm}", spec, device)
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
                }
            )
    sizes = sorted({r["params"] for r in rows})
    gaps = {
        arm: [next(r["gap_vs_ddp_pct"] for r in rows if r["params"] == p and r["arm"] == arm) for p in sizes]
        for arm in ("diloco", "streaming")
    }
    trend = {arm: ("shrinks" if g[-1] < g[0] else "grows") for arm, g in gaps.items()}
    where = f"{device}, islands simulated in one process (islands.simulate; no link: bytes are ledger payload)"
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
        "interconnect": [where],
        "baseline": ["DDP at equal tokens: one model on M x b samples per step (synchronous data parallelism)"],
    }
