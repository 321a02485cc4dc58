"""streaming: peak and total bytes per synchronisation of Streaming DiLoCo against plain DiLoCo."""

from __future__ import annotations

import json
from pathlib import Path

from islands_bench.experiments.outer_common import bar_plot, base_config, gap_pct, row_of, task_words
from islands_bench.experiments.outer_diloco import SCALED
from islands_bench.harness import BenchContext, experiment

BLOCK = 1024  # streaming-diloco's default quantisation block
# A landed fragment becomes the new global plus the tau steps taken since its delta left. LIT-214's
# 0.5 mix dropped half of each outer step here (digits, H=50, F=4, tau=1, fp32: 0.128 vs DiLoCo's 0.109).
LANDING = "landing=replay"


def _plot(result, path):
    bar_plot(result, path, "peak_bytes_per_sync", "peak bytes per sync, per worker (log)", log=True)


def _peak(rec: dict) -> int:
    """Largest single exchange rank 0 sent, from the strategy's outer_exchanges.json (lengths included)."""
    report = json.loads((Path(rec["config"]["output"]["run_dir"]) / "outer_exchanges.json").read_text())
    return int(report["peak_sent_bytes"])


@experiment(
    "streaming",
    practices=("SOTA-155",),
    help="Streaming DiLoCo (F fragments, overlap tau, 4-bit deltas) vs DiLoCo: peak/total bytes per sync at equal loss",
)
def streaming(ctx: BenchContext) -> dict:
    h = 50 if ctx.quick else 100
    if ctx.smoke:  # two rounds; DiLoCo, 4-bit fragments, and 4-bit+zstd at one F
        ctx.smoke_steps = 2 * h
    base = base_config(ctx, quick_steps=200, full_steps=1000)
    runs = [("diloco", f"diloco:inner_steps={h},{SCALED}", 1, "fp32")]
    runs.append(
        (
            "streaming-F4-4bit",
            f"streaming-diloco:inner_steps={h},fragments=4,tau=1,bits=4,block={BLOCK},{LANDING},{SCALED}",
            4,
            "4-bit",
        )
    )
    for f in (2,) if ctx.smoke else (2, 4) if ctx.quick else (2, 4, 8):
        spec = (
            f"streaming-diloco:inner_steps={h},fragments={f},tau=1,bits=4,block={BLOCK},entropy=zstd,{LANDING},{SCALED}"
        )
        runs.append((f"streaming-F{f}-4bit-zstd", spec, f, "4-bit+zstd"))
    ctx.plan(len(runs))
    rows = []
    for label, spec, f, coding in runs:
        rec = ctx.train(label, islands=2, outer=spec, **base)
        rows.append(row_of(label, rec, H=h, fragments=f, coding=coding, peak_bytes_per_sync=_peak(rec)))
    ref = rows[0]
    for r in rows:
        r["loss_gap_pct"] = gap_pct(r["final_val_loss"], ref["final_val_loss"])
        r["peak_cut"] = ref["peak_bytes_per_sync"] / r["peak_bytes_per_sync"]
        r["total_cut"] = ref["bytes_per_worker"] / max(r["bytes_per_worker"], 1)
        r["goal_peak_cut"] = 8 * r["fragments"]
        r["goal_met"] = r["fragments"] > 1 and r["peak_cut"] >= 8 * r["fragments"] and r["loss_gap_pct"] <= 2.0
    headline = [
        f"{task_words(ctx)}, H={h}: Streaming DiLoCo F={r['fragments']} (tau 1, {r['coding']}) cuts peak bytes per "
        "sync "
        f"{r['peak_cut']:.1f}x (goal F x 8 = {8 * r['fragments']}: "
        f"{'met' if r['peak_cut'] >= 8 * r['fragments'] else 'not met'}) "
        f"and total bytes {r['total_cut']:.1f}x vs DiLoCo, final val loss {r['final_val_loss']:.4f} vs "
        f"{ref['final_val_loss']:.4f} ({r['loss_gap_pct']:+.1f}%)"
        for r in rows[1:]
    ] + [
        f"outer step everywhere: {SCALED}; streaming lands fragments with {LANDING}; peak = the largest "
        "single exchange rank 0 sent, measured per exchange (zstd payloads padded to the longest rank's, plus its "
        f"8-byte length); interconnect: {ref['interconnect']}"
    ]
    return {"rows": rows, "headline": headline, "plot": _plot}
