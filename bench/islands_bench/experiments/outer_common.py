"""Shared pieces of the outer-strategy experiments (no experiment is registered here).

Quick versions train the digits MLP (milliseconds per step, so a run costs its process start-up)
and say so in their headlines; full versions train the default byte-level LM. Every outer run uses
two islands of one worker each; the DDP reference is the same two workers in one island.
"""

from __future__ import annotations

from islands_bench.harness import BenchContext
from islands_bench.plots import figure

OUTER_KINDS = ("outer_delta", "outer_params", "outer_inner_state")


def base_config(ctx: BenchContext, quick_steps: int, full_steps: int) -> dict:
    if ctx.quick:
        return dict(
            task="digits",
            steps=quick_steps,
            global_batch=32,
            warmup=max(quick_steps // 10, 1),
            eval_every=0,
            workers=2,
            log_every=max(quick_steps // 20, 1),
        )
    return dict(
        task="lm",
        steps=full_steps,
        global_batch=32,
        warmup=max(full_steps // 10, 1),
        eval_every=max(full_steps // 10, 1),
        workers=2,
        log_every=max(full_steps // 50, 1),
    )


def task_words(ctx: BenchContext) -> str:
    return (
        "digits MLP (quick; the byte LM runs without --quick)"
        if ctx.quick
        else "byte-level LM on Python's stdlib source"
    )


def parameter_count(cfg: dict) -> int:
    from islands.models import MLP, ByteTransformer, count_parameters

    if cfg["task"] == "digits":
        return count_parameters(MLP(64, cfg.get("hidden", 128), 10))
    return count_parameters(
        ByteTransformer(cfg.get("d_model", 128), cfg.get("n_layers", 4), cfg.get("n_heads", 4), cfg.get("context", 128))
    )


def row_of(label: str, rec: dict, **extra) -> dict:
    """The numbers every outer experiment reports for one run (rank 0's ledger; ranks are symmetric)."""
    s, ledger = rec["summary"], rec["comm"]["per_rank"][0]
    outer_sent = sum(ledger["sent"].get(k, 0) for k in OUTER_KINDS)
    outer_calls = sum(ledger["calls"].get(k, 0) for k in OUTER_KINDS)
    return {
        "run": label,
        **extra,
        "final_val_loss": s["final_val_loss"],
        "bytes_per_worker": int(s["mb_sent_per_worker"] * 1e6),
        "syncs": outer_calls if outer_calls else ledger["calls"].get("grad_all_reduce", 0),
        "bytes_per_sync": (outer_sent / outer_calls)
        if outer_calls
        else ledger["sent"].get("grad_all_reduce", 0) / max(ledger["calls"].get("grad_all_reduce", 0), 1),
        "s_per_step": s["seconds_per_step"],
        "interconnect": rec["interconnect_line"],
    }


def gap_pct(loss: float, ref: float) -> float:
    return 100.0 * (loss - ref) / ref


def bar_plot(result: dict, path, key: str, ylabel: str, log: bool = False) -> None:
    rows = result["rows"]
    with figure(path, 1, 2, figsize=(9, 3.8)) as (fig, ax):
        labels = [r["run"] for r in rows]
        ax[0].bar(labels, [r["final_val_loss"] for r in rows])
        ax[0].set_ylabel("final validation loss")
        ax[1].bar(labels, [r[key] for r in rows])
        ax[1].set_ylabel(ylabel)
        if log:
            ax[1].set_yscale("log")
        for a in ax:
            a.tick_params(axis="x", rotation=30, labelsize=7)
        fig.suptitle(
            f"{result['experiment']}{' (quick)' if result['quick'] else ''}\n{result['interconnect'][-1]}", fontsize=8
        )
