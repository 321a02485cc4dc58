"""post-local (SOTA-216): average every step until the first LR decay, then local SGD."""

from __future__ import annotations

from islands_bench.experiments.outer_common import bar_plot, base_config, gap_pct, row_of, task_words
from islands_bench.harness import BenchContext, experiment


def _plot(result, path):
    bar_plot(result, path, "bytes_per_worker", "bytes sent per worker (log)", log=True)


@experiment(
    "post-local",
    practices=("SOTA-216",),
    help="post-local SGD vs averaging every step and vs local SGD from the start: loss and bytes",
)
def post_local(ctx: BenchContext) -> dict:
    h = 16
    if ctx.smoke:  # the switch, then two rounds
        ctx.smoke_steps = 3 * h
    base = base_config(ctx, quick_steps=200, full_steps=800)
    runs = [
        ("every-step", "local-sgd:every=1"),
        (f"post-local-H{h}", f"post-local-sgd:every={h}"),
        (f"local-H{h}", f"local-sgd:every={h}"),
    ]
    rows = [row_of(label, ctx.train(label, islands=2, outer=spec, **base), spec=spec) for label, spec in runs]
    ref, post, local = rows
    for r in rows:
        r["loss_gap_pct"] = gap_pct(r["final_val_loss"], ref["final_val_loss"])
        r["bytes_ratio_every_step_over_run"] = ref["bytes_per_worker"] / max(r["bytes_per_worker"], 1)
    headline = [
        f"{task_words(ctx)}, switch at the first LR decay (step {base['warmup']}) then H={h}: post-local SGD final "
        f"val loss {post['final_val_loss']:.4f} vs every-step averaging {ref['final_val_loss']:.4f} "
        f"({post['loss_gap_pct']:+.1f}%) and local SGD from the start {local['final_val_loss']:.4f} "
        f"({local['loss_gap_pct']:+.1f}%), sending {post['bytes_ratio_every_step_over_run']:.1f}x fewer bytes "
        f"than every-step averaging; interconnect: {ref['interconnect']}",
    ]
    return {"rows": rows, "headline": headline, "plot": _plot}
