"""Shared pieces of the compression experiments: one LM setting, one row per run, loss-curve plots.

Every compression experiment trains the default byte-level language model with 2 data-parallel
workers and compares runs launched side by side in the same invocation. The quick setting is far too
short for the language model to converge (tens of steps on 2 shared cores); it shows direction and
bytes, not final quality, and the headlines say so.
"""

from __future__ import annotations

from islands_bench.harness import SMOKE_LM, BenchContext
from islands_bench.plots import figure


def lm_setting(ctx: BenchContext) -> dict:
    """Config overrides for the default LM: 2 workers, the quick or full length."""
    steps = 40 if ctx.quick else 300
    return dict(
        task="lm",
        workers=2,
        global_batch=16 if ctx.quick else 32,
        steps=steps,
        warmup=max(2, steps // 10),
        eval_every=max(1, steps // 5),
        eval_batches=4 if ctx.quick else 8,
        log_every=max(1, steps // 10),
        **(SMOKE_LM if ctx.smoke else {}),
    )


def curve(rec: dict) -> list[dict]:
    """Validation points of a run: step, val_loss, training seconds so far, MB sent so far."""
    return [{k: p.get(k) for k in ("step", "val_loss", "elapsed", "mb_sent")} for p in rec["series"]["val"]]


def row(label: str, rec: dict, base: dict | None = None, **extra) -> dict:
    """One result row; `base` (the uncompressed ddp run) gives the ratios."""
    s = rec["summary"]
    out = {
        "run": label,
        **extra,
        "final_val_loss": s["final_val_loss"],
        "bytes_per_step": s["bytes_sent_per_worker_per_step"],
        "s_per_step": s["seconds_per_step"],
        # compute time shows how much of a step-time gap is load on the shared cores, not the link
        "compute_s_per_step": s["compute_seconds"] / max(s["steps"], 1),
        "comm_fraction": s["comm_fraction"],
    }
    if base is not None:
        b = base["summary"]
        out["bytes_reduction_x"] = b["bytes_sent_per_worker_per_step"] / max(s["bytes_sent_per_worker_per_step"], 1)
        out["val_loss_vs_ddp_pct"] = 100 * (s["final_val_loss"] / b["final_val_loss"] - 1)
    out["interconnect"] = rec["interconnect_line"]
    return out


def plot_curves(title: str, x: str = "step"):
    """A plot function for the harness: validation loss of every run against `x`."""

    def draw(result: dict, path) -> None:
        with figure(path, figsize=(6.5, 4)) as (fig, ax):
            for label, pts in result["curves"].items():
                ax.plot([p[x] for p in pts], [p["val_loss"] for p in pts], marker="o", ms=3, label=label)
            ax.set_xlabel({"step": "step", "elapsed": "training seconds", "mb_sent": "MB sent per worker"}[x])
            ax.set_ylabel("validation loss")
            ax.set_title(f"{title}\n{result['interconnect'][-1]}", fontsize=8)
            ax.legend(fontsize=7)

    return draw
