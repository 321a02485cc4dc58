"""ckpt-replicas: a data-parallel job's checkpoint with replicas written once (rank 0) against every rank
writing its own full copy.

Under DDP every rank holds the same model and optimizer state; a checkpoint in which each rank writes its
whole tree stores N copies and spends N ranks' CPU encoding them. With `ckpt_share_replicas` (the
default) ranks > 0 reference rank 0's blobs of the same step for every tensor whose content hash matches
and write only what differs (RNG and loader state). The same DDP job runs with sharing on and off, side
by side in one run, gloo on loopback, saves blocking (`ckpt_async=false`) so the stall per checkpoint
is the whole save, every rank's part included (the commit waits for all of them). Measured per
checkpoint: bytes written by all ranks together (the rank*.data files of the newest step directory), the
save time rank 0's record gives, and the training step time. A second job has little to share: two
islands of DiLoCo saving between outer syncs (their models and inner optimizers differ; the outer
state is replicated): sharing must cost it nothing, since every rank still encodes at the same time
(replicas.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from islands_bench.harness import BenchContext, experiment
from islands_bench.plots import figure


def _bytes_per_checkpoint(ckpt_dir: Path) -> tuple[int, dict[int, int]]:
    """(all ranks' data bytes in the newest step directory, per rank)."""
    newest = max(ckpt_dir.glob("step-*"), key=lambda p: p.name)
    per_rank = {int(p.name[4:9]): p.stat().st_size for p in newest.glob("rank*.data")}
    return sum(per_rank.values()), per_rank


def _plot(result: dict, path) -> None:
    rows = result["rows"]
    jobs = list(dict.fromkeys(r["job"] for r in rows))
    with figure(path, 1, 2, figsize=(10, 3.8)) as (fig, axes):
        for ax, key, label in (
            (axes[0], "MB_per_checkpoint", "MB written per checkpoint (all ranks)"),
            (axes[1], "save_s", "seconds per blocking save"),
        ):
            for i, share in enumerate((False, True)):
                vals = [next(r[key] for r in rows if r["job"] == j and r["share_replicas"] == share) for j in jobs]
                ax.bar(
                    [k + 0.4 * i for k in range(len(jobs))],
                    vals,
                    0.4,
                    label="replicas written once" if share else "every rank writes all",
                )
            ax.set_xticks([k + 0.2 for k in range(len(jobs))], jobs, fontsize=8)
            ax.set_title(label, fontsize=9)
        axes[0].legend(fontsize=8)
        fig.suptitle("ckpt-replicas: gloo loopback, state of model + AdamW", fontsize=9)


@experiment(
    "ckpt-replicas", help="DDP checkpoints: replicated state written once by rank 0 vs by every rank (bytes, save time)"
)
def ckpt_replicas(ctx: BenchContext) -> dict:
    counts = (2, 4)
    steps, every = (20, 5) if ctx.quick else (40, 10)
    model = dict(d_model=256, n_layers=4, n_heads=4) if ctx.quick else dict(d_model=384, n_layers=6, n_heads=4)
    if ctx.smoke:  # 2 DDP ranks and 2 DiLoCo islands, a small model
        counts, model = (2,), dict(d_model=64, n_layers=2, n_heads=4)
    rows = []
    jobs = [(f"{w} DDP ranks", w, dict(inner="ddp")) for w in counts]
    # outer syncs every 6 steps, saves every 5: the islands' states differ at each save
    # LIT-212's outer step, whose momentum buffer is part of the saved state (the default step has none)
    jobs.append(
        ("2 DiLoCo islands", 2, dict(islands=2, outer="diloco:inner_steps=6,outer=nesterov,outer_lr=0.7,momentum=0.9"))
    )
    for job, workers, strategy in jobs:
        for share in (False, True):
            label = f"{job.replace(' ', '-')}-{'shared' if share else 'every-rank'}"
            rec = ctx.train(
                label,
                workers=workers,
                steps=steps,
                ckpt_every=every,
                ckpt_async=False,
                ckpt_share_replicas=share,
                eval_every=0,
                probe=False,
                global_batch=4 * workers,
                **strategy,
                **model,
            )
            ck, s = rec["checkpoint"], rec["summary"]
            if ck["share_replicas"] != share:
                raise RuntimeError(f"run {label!r}: share_replicas={ck['share_replicas']}, expected {share}")
            saves = sum(ck["saves"].values())
            total, per_rank = _bytes_per_checkpoint(Path(ck["root"]))
            rows.append(
                {
                    "job": job,
                    "workers": workers,
                    "share_replicas": share,
                    "saves": saves,
                    "MB_per_checkpoint": total / 1e6,
                    "rank0_MB": per_rank[0] / 1e6,
                    "other_rank_MB_max": max((b for r, b in per_rank.items() if r), default=0) / 1e6,
                    "save_s": ck["stall_seconds_total"] / saves,
                    "train_s_per_step": s["seconds_per_step"],
                    "final_val_loss": s["final_val_loss"],
                }
            )
            ctx.log(f"{label}: {total / 1e6:.1f} MB per checkpoint, {rows[-1]['save_s']:.3f} s per save")
    headline = []
    for job, _, _ in jobs:
        off, on = (next(r for r in rows if r["job"] == job and r["share_replicas"] == v) for v in (False, True))
        if off["final_val_loss"] != on["final_val_loss"]:
            raise AssertionError(f"{job}: sharing changed training ({off['final_val_loss']} vs {on['final_val_loss']})")
        headline.append(
            f"{job}: {on['MB_per_checkpoint']:.1f} MB per checkpoint with replicas written once vs "
            f"{off['MB_per_checkpoint']:.1f} MB with every rank writing "
            f"({off['MB_per_checkpoint'] / on['MB_per_checkpoint']:.2f}x "
            f"fewer bytes; ranks > 0 write at most {on['other_rank_MB_max'] * 1e3:.1f} KB each); blocking save "
            f"{on['save_s']:.3f} s vs {off['save_s']:.3f} s ({off['save_s'] / on['save_s']:.2f}x faster on this "
            f"machine's {os.cpu_count()} cores); final validation loss identical ({on['final_val_loss']:.4f})"
        )
    return {
        "rows": rows,
        "headline": headline,
        "plot": _plot,
        "interconnect": ["gloo on loopback, one machine; the store is one local directory all ranks share"],
        "baseline": [
            "the same DDP job with ckpt_share_replicas=false (every rank writes its whole state), "
            "same run; per checkpoint, all ranks together"
        ],
    }
