"""ckpt-crash: kill -9 at random moments while a process saves checkpoints; count loadable outcomes.

A child process (islands_bench.checkpoint_crash) saves deterministic state trees in a loop into one store,
so nearly every kill lands inside a save (staging, data write, manifest, fsync, rename, pointer,
retention). After each SIGKILL the parent opens the store as a restarted job would: partial
directories are cleaned, the newest checkpoint must load and verify, and its content must equal what
that step saved (anything else counts as a silent corruption). The next child resumes from it.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

from islands_bench.checkpoint_crash import run_crash_trials
from islands_bench.harness import BenchContext, experiment
from islands_bench.plots import figure


def _plot(result: dict, path) -> None:
    r = result["rows"][0]
    labels = ["loadable", "silent corruption", "not loadable", "killed before 1st save"]
    vals = [r["loadable"], r["silent_corruptions"], r["not_loadable"], r["no_checkpoint_yet"]]
    with figure(path, figsize=(6, 3.5)) as (fig, ax):
        ax.bar(labels, vals, color=["tab:green", "tab:red", "tab:red", "tab:gray"])
        ax.set_ylabel("trials")
        ax.set_title(f"ckpt-crash: {r['trials']} SIGKILLs during saves", fontsize=9)


@experiment(
    "ckpt-crash",
    practices=("SOTA-056", "SOTA-057"),
    help="repeated kill -9 at random points during saves: loadable outcomes and silent corruptions",
)
def ckpt_crash(ctx: BenchContext) -> dict:
    trials = 3 if ctx.smoke else 30 if ctx.quick else 200
    rows = []
    for elems in (200_000,) if ctx.quick else (20_000, 2_000_000):
        root = Path(tempfile.mkdtemp(prefix="ckpt-crash-", dir=ctx.out_dir))
        try:
            rep = run_crash_trials(root, trials, random.Random(elems), elems=elems, max_delay_s=0.5)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        judged = rep.trials - rep.no_checkpoint_yet
        not_loadable = judged - rep.loadable
        rows.append(
            {
                "tensor_MB": 4 * elems / 1e6,
                "trials": rep.trials,
                "loadable": rep.loadable,
                "judged": judged,
                "not_loadable": not_loadable,
                "silent_corruptions": rep.silent_corruptions,
                "no_checkpoint_yet": rep.no_checkpoint_yet,
                "partials_cleaned": rep.leftovers_cleaned,
                "loadable_fraction": rep.loadable / max(judged, 1),
                "problems": "; ".join(rep.problems[:3]),
            }
        )
        ctx.log(
            f"{elems} elems: {rep.loadable}/{judged} loadable, {rep.silent_corruptions} silent corruptions, "
            f"{rep.leftovers_cleaned} partial saves cleaned"
        )
    headline = [
        f"{r['tensor_MB']:.1f} MB tensor: {r['loadable']}/{r['judged']} kills left a loadable checkpoint "
        f"({100 * r['loadable_fraction']:.0f}%, goal 100%), {r['silent_corruptions']} silent corruptions "
        f"(goal 0), {r['partials_cleaned']} interrupted saves found and cleaned; "
        f"{r['no_checkpoint_yet']} kills came before the first save finished (nothing to lose)"
        for r in rows
    ]
    return {
        "rows": rows,
        "headline": headline,
        "plot": _plot,
        "interconnect": ["none: local disk"],
        "baseline": ["requirement: every kill leaves the previous checkpoint loadable"],
    }
