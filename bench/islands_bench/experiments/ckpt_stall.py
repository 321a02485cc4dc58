"""ckpt-stall (SOTA-056): how long training stops per checkpoint, two-phase asynchronous against synchronous.

Two measurements, side by side in one run:
- store level: the state tree of a ByteTransformer plus its AdamW state, one training step taken before
  every save (so each save writes new bytes, as in training), saved to a fresh CheckpointStore
  synchronously (encode + write + fsync + commit) and through AsyncCheckpointer (stall = snapshot copy;
  the persist is waited for outside the timing so samples do not queue; staging buffers reserved
  before the first save, as the trainer does after its first step). Until Nov 30 the tree did not
  change between saves, so the synchronous saves after the first were dedup hits (measure_stall);
- training loop: the same job (one worker) with ckpt_every=K, ckpt_async on and off; the trainer's
  checkpoint record gives the stall summed over its checkpoints, and the run's wall time shows what the
  background persist costs the training thread on a 2-core machine;
- elastic training loop: an elastic DiLoCo job of 2 workers (islands.runtime.elastic), async on and off.
  Its asynchronous saves meet through the job's TCPStore from the persist thread (elastic_saves.
  PersistBarrier); the blocking ones gather over the members on the training thread.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from islands.checkpoint import CheckpointStore
from islands.checkpoint.store import tree_nbytes
from islands.models import ByteTransformer
from islands_bench.checkpoint_measure import measure_stall
from islands_bench.harness import BenchContext, experiment
from islands_bench.plots import figure


def state_tree(d_model: int, n_layers: int, device: str = "cpu") -> tuple[dict, Callable[[], None]]:
    """(the state tree of a ByteTransformer and its AdamW after one step, a function that takes one more
    training step). The tree holds the live tensors, so each step changes what the next save writes, as
    in training (the store would otherwise dedup every tensor of an unchanged tree)."""
    torch.manual_seed(0)
    model = ByteTransformer(d_model=d_model, n_layers=n_layers, n_heads=4, context=128).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (4, 128), device=device)

    def step() -> None:
        opt.zero_grad()
        model(x).float().mean().backward()
        opt.step()

    step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}, step


def _plot(result: dict, path) -> None:
    rows = [r for r in result["rows"] if r["where"] == "store"]
    labels = [f"{r['state_MB']:.0f} MB" for r in rows]
    with figure(path, figsize=(6, 3.8)) as (fig, ax):
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["sync_s"] for r in rows], 0.4, label="synchronous save")
        ax.bar([x + 0.2 for x in xs], [r["async_stall_s"] for r in rows], 0.4, label="async: stall (snapshot)")
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("seconds training is stopped per checkpoint")
        ax.set_title("ckpt-stall: state tree of model + AdamW", fontsize=9)
        ax.legend(fontsize=8)


@experiment(
    "ckpt-stall",
    practices=("SOTA-056",),
    help="training stall per checkpoint: two-phase async (snapshot, background persist) vs synchronous",
    devices=("cpu", "cuda"),
)
def ckpt_stall(ctx: BenchContext) -> dict:
    torch.set_num_threads(1)
    sizes = [(256, 4), (384, 6)] if ctx.quick else [(256, 4), (512, 6), (768, 8)]
    samples = 3 if ctx.quick else 5
    model = dict(d_model=256, n_layers=4, n_heads=4)  # the training loops'
    if ctx.smoke:  # one small tree, a first and a steady save; small models in the loops
        sizes, samples, model = [(64, 2)], 2, dict(d_model=64, n_layers=2, n_heads=4)
    rows = []
    for d_model, n_layers in sizes:
        tree, advance = state_tree(d_model, n_layers, ctx.device)
        tmp = Path(tempfile.mkdtemp(prefix="ckpt-stall-", dir=ctx.out_dir))
        try:
            count = iter(range(100))
            m = measure_stall(
                lambda tmp=tmp, count=count: CheckpointStore(tmp / f"s{next(count)}", keep_last=1),
                tree,
                list(range(1, samples + 1)),
                advance=advance,
            )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        rows.append(
            {
                "where": "store",
                "config": f"d{d_model} L{n_layers}",
                "state_MB": tree_nbytes(tree) / 1e6,
                "sync_s": m["sync_save_s"],
                "async_stall_s": m["async_stall_s"],
                "async_persist_s": m["async_persist_s"],
                "stall_ratio": m["stall_ratio"],
                "samples": samples,
                "first_stall_s": m["async_stall_first_s"],
                "steady_stall_s": m["async_stall_steady_s"],
                "steady_stall_ratio": m["steady_stall_ratio"],
                "reserve_s": m["reserve_s"],
                "sync_deduped_MB": m["sync_deduped_bytes"] / 1e6,
            }
        )
        ctx.log(f"store d{d_model} L{n_layers}: sync {m['sync_save_s']:.3f} s, async stall {m['async_stall_s']:.4f} s")
    steps, every = (30, 5) if ctx.quick else (80, 10)
    if ctx.device == "cuda":  # steps take ~30 ms there: space saves past one persist so none waits for another
        steps, every = (60, 20) if ctx.quick else (160, 40)
    loop = {}
    for mode in (True, False):
        rec = ctx.train(
            f"loop-{'async' if mode else 'sync'}",
            workers=1,
            steps=steps,
            ckpt_every=every,
            ckpt_async=mode,
            eval_every=0,
            device=ctx.device,
            global_batch=8,
            **model,
        )
        ck, s = rec["checkpoint"], rec["summary"]
        saves = sum(ck["saves"].values())
        loop[mode] = {
            "where": "training loop",
            "config": f"d256 L4, every {every} of {steps} steps",
            "stall_per_ckpt_s": ck["stall_seconds_total"] / saves,
            "saves": saves,
            "train_s_per_step": s["seconds_per_step"],
            "stall_fraction": ck["stall_seconds_total"] / s["wall_seconds"],
            "async": mode,
        }
    rows += [loop[True], loop[False]]
    ratio_loop = loop[True]["stall_per_ckpt_s"] / loop[False]["stall_per_ckpt_s"]
    elastic = {mode: _elastic_loop(ctx, mode, steps, every, model) for mode in (True, False)}
    rows += [elastic[True], elastic[False]]
    ratio_elastic = elastic[True]["stall_per_ckpt_s"] / elastic[False]["stall_per_ckpt_s"]
    headline = [
        f"state {r['state_MB']:.0f} MB, a training step between saves: async stall {r['async_stall_s'] * 1e3:.1f} ms "
        f"vs synchronous save {r['sync_s'] * 1e3:.0f} ms = {100 * r['stall_ratio']:.1f}% (goal <= 10%); first "
        f"snapshot {r['first_stall_s'] * 1e3:.1f} ms, later ones {r['steady_stall_s'] * 1e3:.1f} ms; staging "
        f"buffers reserved beforehand in {r['reserve_s'] * 1e3:.0f} ms (setup, off the training thread); "
        f"{r['sync_deduped_MB']:.2f} MB deduped over the synchronous saves"
        for r in rows[: len(sizes)]
    ]
    headline.append(
        f"in the training loop: stall per checkpoint {loop[True]['stall_per_ckpt_s'] * 1e3:.1f} ms async vs "
        f"{loop[False]['stall_per_ckpt_s'] * 1e3:.0f} ms sync ({100 * ratio_loop:.1f}%); training step "
        f"{loop[True]['train_s_per_step']:.3f} s async vs {loop[False]['train_s_per_step']:.3f} s sync "
        f"(the background persist shares this machine's {os.cpu_count()} cores with training)"
    )
    headline.append(
        f"elastic DiLoCo job, 2 workers (gloo loopback, store barrier over TCP): stall per checkpoint "
        f"{elastic[True]['stall_per_ckpt_s'] * 1e3:.1f} ms async vs {elastic[False]['stall_per_ckpt_s'] * 1e3:.0f}"
        f" ms blocking ({100 * ratio_elastic:.1f}%), {elastic[True]['saves']} vs {elastic[False]['saves']} saves"
    )
    if ctx.device == "cuda":
        headline.append(
            f"state on {torch.cuda.get_device_name()}: the snapshot is a device-to-host copy into reused "
            "pinned buffers; the synchronous save includes the same copy"
        )
    return {
        "rows": rows,
        "headline": headline,
        "plot": _plot,
        "baseline": ["synchronous save of the same tree to the same kind of store, same run"],
    }


def _elastic_loop(ctx: BenchContext, mode: bool, steps: int, every: int, model: dict) -> dict:
    """One elastic DiLoCo job of 2 workers saving every `every` steps; its checkpoint stall per save."""
    label = f"elastic-{'async' if mode else 'sync'}"
    # LIT-212's outer step, whose momentum buffer is part of each snapshot (the default step has none)
    outer = "diloco:inner_steps=5,outer=nesterov,outer_lr=0.7,momentum=0.9"
    rec = ctx.train_elastic(
        label,
        workers=2,
        islands=2,
        outer=outer,
        elastic=True,
        steps=steps,
        ckpt_every=every,
        ckpt_async=mode,
        eval_every=0,
        probe=False,
        global_batch=16,
        **model,
    )
    ck, s = rec["checkpoint"], rec["summary"]
    saves = sum(ck["saves"].values())
    if ck["async"] != mode or not saves:
        raise RuntimeError(f"elastic run {label!r}: async={ck['async']} with {saves} saves; expected async={mode}")
    return {
        "where": "elastic training loop",
        "config": f"d256 L4, DiLoCo H=5, 2 workers, every {every} of {steps} steps",
        "stall_per_ckpt_s": ck["stall_seconds_total"] / saves,
        "saves": saves,
        "abandoned": len(ck["abandoned_membership_change"]),
        "train_s_per_step": s["seconds_per_step"],
        "stall_fraction": ck["stall_seconds_total"] / s["wall_seconds"],
        "async": mode,
    }
