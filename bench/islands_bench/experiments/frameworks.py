"""frameworks: islands inside the trainers people use (issue #35), against those trainers alone.

The same transformers GPT-2 (random initialisation from a config; 2 layers, width 64, on the bytes of Python's own
json, email and http packages) trained through (a) the Hugging Face Trainer and (b) a LightningModule, each:
  ddp       plain DDP over all 4 workers (one job): every step all-reduces the gradients over the 4
  islands   2 islands x 2 workers, each island its own job (`islands run --separate-jobs`), DDP inside, DiLoCo
            (H inner steps, SOTA-047 / arXiv 2311.08105) across through islands' callback
and, for reference, islands' own path on the same model, data, batch and H without a framework (a plain loop, torch's
DDP inside each island, `strategy.attach`; quick and full tiers).
Per arm: the validation loss of the final (global) model, the bytes each worker sent across islands (islands' cross
ledger; for ddp the payload of its gradient all-reduce, which would cross the link if its 4 workers were 2 islands),
and the callback's cost: the median time of the outer strategy's hooks on a step that does not synchronise, against
the median time of such a step of the framework, both timed in the same process (the goal: at most 2%). All arms run
on one machine, gloo over loopback TCP, so the link is not what is measured; the bytes are.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from islands_bench.experiments import frameworks_worker
from islands_bench.harness import BenchContext, experiment

INTERCONNECT = "one machine, gloo over loopback TCP (127.0.0.1), not shaped; 1 thread per worker"


def _arm(ctx: BenchContext, framework: str, outer: bool, spec: dict) -> list[dict]:
    """One arm as `islands run` runs it; every worker's record."""
    label = f"{framework}-{'islands' if outer else 'ddp'}" + (f"-seed{spec['seed']}" if spec.get("seed") else "")
    out = ctx.out_dir / "runs" / label
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("island*-rank*.json"):
        old.unlink()
    full = {**spec, "framework": framework, "outer": outer, "tmp": str(out / "trainer")}
    launch = ["--workers", "4"] + (["--islands", "2", "--separate-jobs"] if outer else [])
    argv = [sys.executable, "-m", "islands", "run", *launch, "--run-dir", str(out / "job")]
    argv += [frameworks_worker.__file__, json.dumps(full), str(out)]
    with ctx.arm(label):
        ctx.log(f"{label}: {spec['steps']} steps" + (f", DiLoCo H={spec['inner_steps']}" if outer else ""))
        done = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if done.returncode != 0:
            logs = "".join(p.read_text()[-2000:] for p in sorted((out / "job" / "logs").rglob("*.log")))
            raise RuntimeError(f"frameworks arm {label} failed (exit {done.returncode}):\n{done.stderr[-3000:]}{logs}")
    records = [json.loads(p.read_text()) for p in sorted(out.glob("island*-rank*.json"))]
    if len(records) != 4:
        raise RuntimeError(f"frameworks arm {label}: {len(records)} of 4 workers wrote a record")
    return records


CALLBACKS = ("hf", "lightning")  # the frameworks whose callback the parity runs hold against islands' own loop


def _parity(ctx: BenchContext, spec: dict, seeds: tuple[int, ...], rows: list[dict]) -> dict:
    """DiLoCo through each callback (HF Trainer, Lightning) against islands' own loop (same model, data, batch, H,
    optimizer, clipping), each under data-order seeds 0 (the rows' runs) and `seeds`: the final validation loss per
    seed, the mean and spread of each, and whether a callback's mean differs from the loop's by less than the seeds'
    noise (two standard errors of the difference of two means, from the pooled per-seed standard deviation); and
    the bytes each sent across."""
    by = {k: [r for r in rows if r["framework"] == k and r["H"]] for k in (*CALLBACKS, "loop")}
    losses = {k: [v[0]["val_loss"]] for k, v in by.items()}
    across = {k: [v[0]["MB_across_per_worker"]] for k, v in by.items()}
    for seed in seeds:
        for framework in (*CALLBACKS, "loop"):
            recs = _arm(ctx, framework, True, {**spec, "seed": seed})
            losses[framework].append(statistics.fmean(r["val_loss"] for r in recs))
            across[framework].append(round(statistics.fmean(r["cross_bytes"] for r in recs) / 1e6, 3))
    n = len(losses["loop"])
    mean = {k: statistics.fmean(v) for k, v in losses.items()}
    sd = {k: statistics.stdev(v) for k, v in losses.items()}
    out: dict = {
        "seeds": [0, *seeds],
        "val_loss": {k: [round(x, 4) for x in v] for k, v in losses.items()},
        "mean": {k: round(v, 4) for k, v in mean.items()},
        "sd": {k: round(v, 4) for k, v in sd.items()},
        "MB_across_per_worker": across,
        "H": spec["inner_steps"],
        "steps": spec["steps"],
        "interconnect": INTERCONNECT,
        "against_loop": {},
    }
    names = {"hf": "HF Trainer", "lightning": "Lightning"}
    parts = []
    for k in CALLBACKS:
        pooled = ((sd[k] ** 2 + sd["loop"] ** 2) / 2) ** 0.5
        band = 2 * pooled * (2 / n) ** 0.5
        diff = mean[k] - mean["loop"]
        same_bytes = across[k] == across["loop"]
        out["against_loop"][k] = {
            "difference": round(diff, 4),
            "noise_band": round(band, 4),
            "within_noise": abs(diff) <= band,
            "same_bytes": same_bytes,
        }
        parts.append(
            f"{names[k]} + callback {mean[k]:.3f} +- {sd[k]:.3f}, difference {diff:+.3f}, noise band +-{band:.3f} "
            f"({'within' if abs(diff) <= band else 'OUTSIDE'} noise), MB across per worker "
            f"{'the same' if same_bytes else 'DIFFERENT'} ({across[k]})"
        )
    out["headline"] = (
        f"parity over {n} data-order seeds (each callback vs islands' own loop, 2x2, H={spec['inner_steps']}, "
        f"{spec['steps']} steps; val loss, sd over seeds): own loop {mean['loop']:.3f} +- {sd['loop']:.3f} "
        f"({across['loop']} MB across); " + "; ".join(parts) + f" [{INTERCONNECT}]"
    )
    return out


@experiment(
    "frameworks",
    practices=("SOTA-047",),
    help="HF Trainer and Lightning: plain DDP over 4 workers vs 2 islands x 2 (DiLoCo through islands' callback): "
    "loss, bytes across, the callback's cost per step",
)
def frameworks(ctx: BenchContext) -> dict:
    if ctx.smoke:
        spec = {"steps": 6, "inner_steps": 3}
    elif ctx.quick:
        spec = {"steps": 100, "inner_steps": 50}
    else:
        spec = {"steps": 500, "inner_steps": 50}
    # the Trainer's defaults for weight decay and gradient clipping, given to every arm alike
    spec.update(context=64, batch=8, lr=3e-3, weight_decay=0.0, max_grad_norm=1.0, val_windows=4 if ctx.smoke else 64)
    arms = [(fw, outer) for fw in ("hf", "lightning") for outer in (False, True)]
    arms.append(("loop", True))  # islands' own path on the same model, data, batch and H: no framework
    # parity: each callback and islands' own loop again under other data-order seeds, for the seeds' noise band
    seeds = () if ctx.smoke else (1, 2) if ctx.quick else (1, 2, 3, 4)
    if ctx.smoke:  # one arm of each kind: each framework's path once, plain DDP once and the callback once
        arms = [("hf", False), ("lightning", True)]
    ctx.plan(len(arms) + (len(CALLBACKS) + 1) * len(seeds))
    rows, headline = [], []
    for framework, outer in arms:
        recs = _arm(ctx, framework, outer, spec)
        params = recs[0]["parameters"]
        steps = recs[0]["steps"]
        if outer:
            across = statistics.fmean(r["cross_bytes"] for r in recs)
            what = "islands' cross ledger"
        else:
            across = float(steps * params * 4)  # fp32 gradient all-reduce payload per step
            what = "gradient all-reduce payload (would cross)"
        step_ms = 1000 * statistics.median(r["step_s"] for r in recs if r["step_s"] is not None)
        hooks = [r["hook_s"] for r in recs if r["hook_s"] is not None]
        hook_ms = 1000 * statistics.median(hooks) if outer and hooks else None
        sync = [r["sync_hook_s"] for r in recs if r["sync_hook_s"] is not None]
        losses = sorted({round(r["val_loss"], 6) for r in recs if r["val_loss"] is not None})
        rows.append(
            {
                "framework": framework,
                "arm": (
                    "2 islands x 2, DiLoCo via attach in a plain loop"
                    if framework == "loop"
                    else "2 islands x 2, DiLoCo via callback"
                    if outer
                    else "DDP over 4"
                ),
                "steps": steps,
                "H": spec["inner_steps"] if outer else None,
                "val_loss": losses[0] if len(losses) == 1 else losses,
                "MB_across_per_worker": round(across / 1e6, 3),
                "bytes_are": what,
                "step_ms": round(step_ms, 3),
                "callback_ms_per_step": round(hook_ms, 4) if hook_ms is not None else None,
                "callback_share": round(hook_ms / step_ms, 5) if hook_ms is not None else None,
                "sync_step_callback_ms": round(1000 * statistics.median(sync), 2) if outer and sync else None,
                # the outer exchange itself (the all-reduce across islands and the outer step), spread over its H
                # steps: what the islands pay for DiLoCo, not the callback's overhead
                "sync_share_amortised": (
                    round(statistics.median(sync) / spec["inner_steps"] / (step_ms / 1000), 5)
                    if outer and sync
                    else None
                ),
                "rounds": recs[0]["rounds"],
                "interconnect": INTERCONNECT,
            }
        )
    for framework in ("hf", "lightning"):
        pair = [r for r in rows if r["framework"] == framework]
        if len(pair) != 2:  # the smoke tier runs one arm of a framework
            continue
        ddp, isl = pair
        share = isl["callback_share"]
        headline.append(
            f"{framework}: DiLoCo through the callback (2x2, H={spec['inner_steps']}) val loss {isl['val_loss']} vs "
            f"DDP over 4 {ddp['val_loss']}; {isl['MB_across_per_worker']} MB across per worker vs "
            f"{ddp['MB_across_per_worker']} MB of DDP gradients "
            f"({ddp['MB_across_per_worker'] / max(isl['MB_across_per_worker'], 1e-9):.1f}x less); the callback's "
            f"hooks {isl['callback_ms_per_step']} ms on a {isl['step_ms']} ms step "
            f"({100 * share if share is not None else float('nan'):.2f}%, goal <= 2%); the synchronising step's "
            f"exchange {isl['sync_step_callback_ms']} ms, {100 * (isl['sync_share_amortised'] or 0):.2f}% of a step "
            f"spread over H [{INTERCONNECT}]"
        )
    loop = [r for r in rows if r["framework"] == "loop"]
    if loop:
        others = ", ".join(
            f"{r['framework']} {r['val_loss']} / {r['MB_across_per_worker']} MB"
            for r in rows
            if r["arm"].endswith("via callback")
        )
        headline.append(
            f"islands' own path (plain loop, torch DDP inside, attach; same model, data, batch, H): val loss "
            f"{loop[0]['val_loss']}, {loop[0]['MB_across_per_worker']} MB across per worker; through the callbacks: "
            f"{others} (each framework draws its own data order, so losses differ by that order's noise) "
            f"[{INTERCONNECT}]"
        )
    parity = _parity(ctx, spec, seeds, rows) if seeds else None
    if parity is not None:
        headline.append(parity.pop("headline"))
    return {
        "rows": rows,
        "parity": parity,
        "headline": headline,
        "interconnect": [INTERCONNECT],
        "baseline": [
            "the same framework, model, data, batch per worker and step count as plain DDP over all 4 workers "
            "(one job), in the same invocation",
            "callback cost: the framework's own step time in the same process (median over steps that do not "
            "synchronise)",
        ],
        "spec": spec,
    }
