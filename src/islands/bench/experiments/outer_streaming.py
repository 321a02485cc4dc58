"""streaming: peak and total bytes per synchronisation of Streaming DiLoCo against plain DiLoCo."""

from __future__ import annotations

import math

from islands.bench.experiments.outer_common import bar_plot, base_config, gap_pct, parameter_count, row_of, task_words
from islands.bench.harness import BenchContext, experiment
from islands.sync.outer.quant4 import Quant4

BLOCK = 1024  # streaming-diloco's default quantisation block


def _plot(result, path):
    bar_plot(result, path, "bytes_per_sync", "peak bytes per sync, per worker (log)", log=True)


@experiment("streaming", practices=("SOTA-155",),
            help="Streaming DiLoCo (F fragments, overlap tau, 4-bit deltas) vs DiLoCo: peak/total bytes per sync at equal loss")
def streaming(ctx: BenchContext) -> dict:
    base = base_config(ctx, quick_steps=200, full_steps=1000)
    h = 50 if ctx.quick else 100
    n = parameter_count(base)
    rows = [row_of("diloco", ctx.train("diloco", islands=2, outer=f"diloco:inner_steps={h}", **base),
                   H=h, fragments=1, bits=32, peak_bytes_analytic=4 * n)]
    for f in (2, 4) if ctx.quick else (2, 4, 8):
        spec = f"streaming-diloco:inner_steps={h},fragments={f},tau=1,bits=4,block={BLOCK}"
        rec = ctx.train(f"streaming-F{f}", islands=2, outer=spec, **base)
        rows.append(row_of(f"streaming-F{f}", rec, H=h, fragments=f, bits=4,
                           peak_bytes_analytic=Quant4(BLOCK).payload_nbytes(math.ceil(n / f))))
    ref = rows[0]
    for r in rows:
        r["loss_gap_pct"] = gap_pct(r["final_val_loss"], ref["final_val_loss"])
        r["peak_cut"] = ref["peak_bytes_analytic"] / r["peak_bytes_analytic"]
        r["total_cut"] = ref["bytes_per_worker"] / max(r["bytes_per_worker"], 1)
        r["peak_measured_le_analytic"] = r["bytes_per_sync"] <= r["peak_bytes_analytic"]
    headline = [
        f"{task_words(ctx)}, H={h}: Streaming DiLoCo F={r['fragments']} (tau 1, 4-bit) cuts peak bytes per sync "
        f"{r['peak_cut']:.1f}x (F x 8 = {8 * r['fragments']}; block scales cost the rest) and total bytes "
        f"{r['total_cut']:.1f}x vs DiLoCo, final val loss {r['final_val_loss']:.4f} vs {ref['final_val_loss']:.4f} "
        f"({r['loss_gap_pct']:+.1f}%)"
        for r in rows[1:]
    ] + [f"interconnect: {ref['interconnect']}; peak = largest single exchange a worker sends "
         f"(fragments differ by at most one value)"]
    return {"rows": rows, "headline": headline, "plot": _plot, "parameters": n}
