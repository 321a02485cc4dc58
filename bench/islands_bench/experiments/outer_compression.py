"""outer-compression: DiLoCo's pseudo-gradients compressed (issue 19), against fp32 DiLoCo at the same H.

For each compressor, with and without error feedback: bytes per outer round per worker (from the ledger:
every byte of the outer exchanges, NaN flags included, over the number of exchanges), the cut against fp32
DiLoCo, and the final validation loss with its gap. The goal (issue 19): at least 146x fewer bytes per
round than fp32 DiLoCo with a final loss within 1% of it at the same H. Every run: 2 islands of one
worker, the same outer step (plain SGD, lr sqrt(M), the setting diloco-vs-ddp found best).
"""

from __future__ import annotations

from islands_bench.experiments.outer_common import bar_plot, base_config, gap_pct, task_words
from islands_bench.experiments.outer_diloco import SCALED
from islands_bench.harness import BenchContext, experiment

GOAL_CUT = 146.0  # SparseLoCo's reported cut against dense pseudo-gradients (issue 19)
GOAL_GAP_PCT = 1.0
# Kinds an outer round sends: fp32 deltas, or a compressed exchange (NaN flag, payload, agreement round).
ROUND_KINDS = ("outer_delta", "compress_finite", "compress_gather", "compress_sum", "compress_agree", "outer_buffers")
EXCHANGE_KINDS = ("outer_delta", "compress_finite")  # one call of one of these per exchange

# (label, spec with error feedback, spec without): 1% of each chunk everywhere
COMPRESSORS = [
    ("topkq-2bit", "topkq:ratio=0.01,bits=2", "topkq:ratio=0.01,bits=2,ef=0"),  # SparseLoCo's payload
    ("topkq-4bit", "topkq:ratio=0.01,bits=4", "topkq:ratio=0.01,bits=4,ef=0"),
    ("topkq-8bit", "topkq:ratio=0.01,bits=8", "topkq:ratio=0.01,bits=8,ef=0"),
    ("dct-topk-2bit", "dct-topk:ratio=0.01,bits=2", "dct-topk:ratio=0.01,bits=2,ef=0"),  # DeMo's transform
    # without error feedback the shared random-k is rescaled by n/k (unbiased); with it, unscaled (contractive)
    ("randomk-shared", "randomk-shared:ratio=0.01", "randomk-shared:ratio=0.01,rescale=1,ef=0"),
    # the reference: plain top-k, fp32 values and int32 indices, no warm-up
    ("topk-fp32", "topk:ratio=0.01,warmup=0,ef=1", "topk:ratio=0.01,warmup=0,ef=0"),
]
# How dense SparseLoCo's payload must be for the loss goal at this run length (error feedback on)
DENSITIES = (0.03, 0.1)


def _plot(result, path):
    bar_plot(result, path, "bytes_per_round", "bytes per outer round, per worker (log)", log=True)


def round_bytes(rec: dict) -> tuple[int, float]:
    """(exchanges, mean bytes rank 0 sent per exchange) from its ledger."""
    ledger = rec["comm"]["per_rank"][0]
    exchanges = sum(ledger["calls"].get(k, 0) for k in EXCHANGE_KINDS)
    sent = sum(ledger["sent"].get(k, 0) for k in ROUND_KINDS)
    return exchanges, sent / max(exchanges, 1)


def row_of(label: str, rec: dict, **extra) -> dict:
    s = rec["summary"]
    exchanges, per_round = round_bytes(rec)
    return {"run": label, **extra, "rounds": exchanges, "bytes_per_round": per_round,
            "final_val_loss": s["final_val_loss"], "bytes_per_worker": int(s["mb_sent_per_worker"] * 1e6),
            "s_per_step": s["seconds_per_step"], "interconnect": rec["interconnect_line"]}


@experiment("outer-compression", practices=("SOTA-155", "SOTA-214", "SOTA-902", "SOTA-903"),
            help="DiLoCo's pseudo-gradients through topkq (SparseLoCo), dct-topk (DeMo), shared random-k and top-k, "
                 "with and without error feedback: bytes per round and final loss vs fp32 DiLoCo at the same H")
def outer_compression(ctx: BenchContext) -> dict:
    # quick: the digits MLP, 40 rounds (at H=50 it would have 4); full: the byte LM, 30 rounds (600 steps keep the
    # 15 runs near an hour on 2 shared cores)
    base = base_config(ctx, quick_steps=200, full_steps=600)
    h = 5 if ctx.quick else 20
    diloco = f"diloco:inner_steps={h},{SCALED}"
    ctx.plan(1 + 2 * len(COMPRESSORS) + len(DENSITIES))
    ref = row_of("diloco-fp32", ctx.train("diloco-fp32", islands=2, outer=diloco, **base),
                 compressor="none", ef=None, H=h)
    rows = [ref]
    for label, with_ef, without_ef in COMPRESSORS:
        for ef, spec in ((True, with_ef), (False, without_ef)):
            run = f"{label}-{'ef' if ef else 'no-ef'}"
            rec = ctx.train(run, islands=2, outer=f"{diloco},compressor=({spec})", **base)
            rows.append(row_of(run, rec, compressor=spec, ef=ef, H=h))
    for density in DENSITIES:
        spec = f"topkq:ratio={density},bits=2"
        run = f"topkq-2bit-{density:g}-ef"
        rows.append(row_of(run, ctx.train(run, islands=2, outer=f"{diloco},compressor=({spec})", **base),
                           compressor=spec, ef=True, H=h))
    for r in rows:
        r["cut_vs_fp32"] = ref["bytes_per_round"] / r["bytes_per_round"]
        r["loss_gap_pct"] = gap_pct(r["final_val_loss"], ref["final_val_loss"])
        r["goal_met"] = r["cut_vs_fp32"] >= GOAL_CUT and r["loss_gap_pct"] <= GOAL_GAP_PCT
    by = {r["run"]: r for r in rows}
    sparse = by["topkq-2bit-ef"]
    met = [r["run"] for r in rows[1:] if r["goal_met"]]
    headline = [
        f"{task_words(ctx)}, {base['steps']} steps, H={h}, 2 islands: topkq 1% with 2-bit values and error feedback "
        f"(SparseLoCo's payload) sends {sparse['bytes_per_round']:,.0f} B per round against fp32 DiLoCo's "
        f"{ref['bytes_per_round']:,.0f} ({sparse['cut_vs_fp32']:.0f}x fewer; goal {GOAL_CUT:.0f}x), final val loss "
        f"{sparse['final_val_loss']:.4f} vs {ref['final_val_loss']:.4f} ({sparse['loss_gap_pct']:+.2f}%; goal within "
        f"{GOAL_GAP_PCT:.0f}%): goal {'met' if sparse['goal_met'] else 'not met'}",
        "with / without error feedback (cut, loss gap): " + "; ".join(
            f"{label} {by[label + '-ef']['cut_vs_fp32']:.0f}x {by[label + '-ef']['loss_gap_pct']:+.1f}% / "
            f"{by[label + '-no-ef']['cut_vs_fp32']:.0f}x {by[label + '-no-ef']['loss_gap_pct']:+.1f}%"
            for label, _, _ in COMPRESSORS),
        "denser topkq 2-bit with error feedback (cut, loss gap): 1% " + f"{sparse['cut_vs_fp32']:.0f}x "
        f"{sparse['loss_gap_pct']:+.1f}%; " + "; ".join(
            f"{d * 100:g}% {by[f'topkq-2bit-{d:g}-ef']['cut_vs_fp32']:.0f}x {by[f'topkq-2bit-{d:g}-ef']['loss_gap_pct']:+.1f}%"
            for d in DENSITIES),
        f"runs meeting both goals (>= {GOAL_CUT:.0f}x, within {GOAL_GAP_PCT:.0f}%): {', '.join(met) or 'none'}; "
        f"outer step everywhere: {SCALED}; bytes per round = every byte of rank 0's outer exchanges (NaN flag "
        f"included) / exchanges; interconnect: {ref['interconnect']}",
    ]
    return {"rows": rows, "headline": headline, "plot": _plot}
