"""wrap-policy (Q-2, SOTA-029/030): FSDP step time and bytes by wrap policy against DDP, in one invocation.

Same model, batch and workers for every run. The spread of FSDP's step time across policies bounds how
much of its overhead over DDP the policy decides; what stays under the best policy is sharding itself.
"""

from __future__ import annotations

from islands_bench.experiments.sharding_common import best_of_two_passes, lm_config, ratio
from islands_bench.harness import BenchContext, experiment
from islands_bench.plots import figure


def _policies(d: int) -> list[tuple[str, str, bool]]:
    """(label, wrap spec, reshard_after_forward)."""
    per_linear = d * d  # every Linear in a block holds at least d^2 weights: one unit per layer
    return [
        ("model", "model", True),
        ("block", "block", True),
        ("block-keep", "block", False),
        ("per-layer", f"params:{per_linear}", True),
    ]


def _plot(result: dict, path) -> None:
    rows = result["rows"]
    labels = [r["run"] for r in rows]
    with figure(path, 1, 2, figsize=(10, 4)) as (fig, (a, b)):
        a.bar(labels, [r["s_per_step"] for r in rows], color=["grey"] + ["tab:blue"] * (len(rows) - 1))
        a.set_ylabel("median s per step")
        a.tick_params(axis="x", rotation=30, labelsize=7)
        b.bar(labels, [r["wire_mb_per_step"] for r in rows], color=["grey"] + ["tab:orange"] * (len(rows) - 1))
        b.set_ylabel("ring wire MB per step per rank")
        b.tick_params(axis="x", rotation=30, labelsize=7)
        fig.suptitle(f"wrap-policy: FSDP by wrap policy vs DDP\n{result['interconnect'][-1]}", fontsize=8)


@experiment(
    "wrap-policy",
    practices=("Q-2", "SOTA-029", "SOTA-030"),
    help="FSDP step time and bytes under whole-model, per-block, per-layer wrapping vs DDP",
)
def wrap_policy(ctx: BenchContext) -> dict:
    d, layers, steps = (64, 2, 4) if ctx.smoke else (256, 4, 8) if ctx.quick else (384, 6, 30)
    configs = [("ddp", lm_config(d, layers, steps, 2))]
    configs += [
        (f"fsdp-{label}", lm_config(d, layers, steps, 2, inner="fsdp", wrap=wrap, reshard=reshard))
        for label, wrap, reshard in _policies(d)
    ]
    rows = best_of_two_passes(ctx, configs)
    ddp = rows[0]
    for r in rows:
        r["time_vs_ddp"] = ratio(r["s_per_step"], ddp["s_per_step"])
        r["wire_vs_ddp"] = ratio(r["wire_mb_per_step"], ddp["wire_mb_per_step"])
    fsdp = rows[1:]
    best = min(fsdp, key=lambda r: r["s_per_step"])
    worst = max(fsdp, key=lambda r: r["s_per_step"])
    over_best, over_worst = best["s_per_step"] - ddp["s_per_step"], worst["s_per_step"] - ddp["s_per_step"]
    spread = worst["s_per_step"] - best["s_per_step"]
    if over_worst <= 0:
        share = (
            f"every policy stepped no slower than DDP (worst {over_worst:+.3f} s/step): on this link neither "
            f"the policy nor sharding costs measurable time; the policies differ by {spread:.3f} s/step"
        )
    elif over_best <= 0:
        share = (
            f"under the best policy FSDP costs nothing measurable over DDP ({over_best:+.3f} s/step), so all of "
            f"the worst policy's {over_worst:+.3f} s/step is the policy's, none is sharding's, on this link"
        )
    else:
        share = (
            f"the policy moves {spread:.3f} s of the worst policy's {over_worst:+.3f} s/step overhead "
            f"({100 * ratio(spread, over_worst):.0f}%); {over_best:+.3f} s/step stays under the best policy"
        )
    headline = [
        f"FSDP over DDP ({ddp['s_per_step']:.3f} s/step): best policy {best['run']} {best['time_vs_ddp']:.2f}x, "
        f"worst {worst['run']} {worst['time_vs_ddp']:.2f}x at d={d}, {layers} layers, 2 workers (faster of two passes)",
        share,
        "wire bytes per step: "
        + ", ".join(f"{r['run']} {r['wire_vs_ddp']:.2f}x" for r in fsdp)
        + " of DDP's (the root unit is gathered once; other units twice unless kept, SOTA-030)",
        "baseline: per worker, one process with 1 thread, 2 workers on loopback; load_avg per row shows other load",
    ]
    return {"rows": rows, "headline": headline, "plot": _plot}
