"""ckpt-levels (SOTA-057): multi-level checkpoints -- what each level costs, how fast it restores, and how
much work a failure loses given each level's interval; a rank loss restored from the peer copy.

Three measurements in one run:
- per level (one process, model + AdamW state of the job's model size): synchronous save cost and restore
  time of the memory level (packed bytes in this process), the local-disk store and the second directory
  standing for remote storage (same disk here, so "remote" costs what local does: stated, not hidden);
- a real 2-rank gloo job through the trainer's CheckpointDriver (memory level replicated to rank
  (r+1) % n, local and remote levels at their own intervals): at the failure step rank 1 loses its
  memory and state (as a replacement process would) and gets them back from rank 0's copy; each
  level's newest restorable step gives the work that level would have lost, each restore is timed and
  compared bit for bit with the state the rank had at that step;
- expected lost work per failure class (uniform failure time: half a level's interval plus its
  restore), for four level stacks at the same intervals, with the checkpoint overhead each stack adds
  per step from the measured save costs (memory and peer copies are taken synchronously here; disk
  levels persist in the background, so their training-thread cost is the snapshot, see ckpt-stall).
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path

import torch

from islands.checkpoint.store import tree_nbytes
from islands_bench.checkpoint_levels import level_costs, rank_loss_job
from islands_bench.experiments.ckpt_stall import state_tree
from islands_bench.harness import BenchContext, experiment
from islands_bench.plots import figure

# Failure classes and the levels that survive each (SOTA-057: tiers exist because failures differ in
# what they take down). A peer copy survives a machine loss only if the successor rank is on another
# machine, which is how ranks are laid out one per host in this project's testbeds.
FAILURES = {
    "rollback in a live process (loss spike, caught error)": ("memory", "memory-peer", "local", "remote"),
    "one process dies": ("memory-peer", "local", "remote"),
    "one machine lost (process + local disk)": ("memory-peer", "remote"),
    "whole job restarts (all processes)": ("local", "remote"),
    "all machines lost": ("remote",),
}
STACKS = {
    "local only": ("local",),
    "local + remote": ("local", "remote"),
    "memory + local + remote": ("memory", "local", "remote"),
    "memory+peer + local + remote": ("memory", "memory-peer", "local", "remote"),
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expected_loss(
    stack: tuple[str, ...], survivors: tuple[str, ...], every: dict, iter_s: float, restore_s: dict
) -> tuple[float, str] | None:
    """(expected seconds lost, level used): the surviving level of the stack with the least expected loss."""
    options = [(every[lv] / 2 * iter_s + restore_s[lv], lv) for lv in stack if lv in survivors]
    return min(options) if options else None


def _plot(result: dict, path) -> None:
    rows = [r for r in result["rows"] if r["part"] == "expected loss"]
    stacks = list(dict.fromkeys(r["stack"] for r in rows))
    failures = list(dict.fromkeys(r["failure"] for r in rows))
    with figure(path, figsize=(9, 4)) as (fig, ax):
        width = 0.8 / len(stacks)
        for i, stack in enumerate(stacks):
            vals = [
                next((r["expected_lost_s"] for r in rows if r["stack"] == stack and r["failure"] == f), None)
                for f in failures
            ]
            xs = [j + i * width for j in range(len(failures))]
            ax.bar(xs, [float("nan") if v is None else v for v in vals], width, label=stack)
            for x, v in zip(xs, vals):
                if v is None:  # no level of this stack survives: the job restarts from scratch
                    ax.text(x, 0, "lost\nall", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(
            [j + width * (len(stacks) - 1) / 2 for j in range(len(failures))],
            [f.split(" (")[0] for f in failures],
            fontsize=8,
        )
        ax.set_ylabel("expected work lost per failure (s)")
        ax.set_title("ckpt-levels: lost work by failure class and level stack", fontsize=9)
        ax.legend(fontsize=7)


@experiment(
    "ckpt-levels",
    practices=("SOTA-057",),
    help="multi-level checkpoints: save cost and restore time per level, expected lost work per failure "
    "class, a rank loss restored from the peer's memory copy",
)
def ckpt_levels(ctx: BenchContext) -> dict:
    torch.set_num_threads(1)
    plan = (
        {"memory_every": 2, "local_every": 4, "remote_every": 8, "fail_at": 13, "d_model": 32, "n_layers": 1}
        if ctx.smoke
        else {"memory_every": 2, "local_every": 10, "remote_every": 20, "fail_at": 37, "d_model": 128, "n_layers": 2}
        if ctx.quick
        else {"memory_every": 5, "local_every": 50, "remote_every": 200, "fail_at": 397, "d_model": 256, "n_layers": 4}
    )
    tree, _ = state_tree(plan["d_model"], plan["n_layers"])  # the job's own model: costs and steps match
    tmp = Path(tempfile.mkdtemp(prefix="ckpt-levels-", dir=ctx.out_dir))
    try:
        costs = level_costs(tree, tmp, samples=1 if ctx.smoke else 3 if ctx.quick else 5)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    state_mb = tree_nbytes(tree) / 1e6
    rows = [
        {
            "part": "level cost",
            "level": c["level"],
            "state_MB": state_mb,
            "save_s": c["save_s"],
            "restore_s": c["restore_s"],
            "samples": c["samples"],
        }
        for c in costs
    ]
    for c in costs:
        ctx.log(f"{c['level']}: save {c['save_s']:.3f} s, restore {c['restore_s']:.3f} s ({state_mb:.0f} MB)")
    ranks = rank_loss_job(plan, tmp_parent=ctx.out_dir, port=_port())
    for r in ranks:
        for name, lv in r["levels"].items():
            rows.append(
                {
                    "part": "rank loss (2 gloo ranks)",
                    "rank": r["rank"],
                    "lost_rank": r["rank"] == 1,
                    "level": name,
                    "restored_step": lv["step"],
                    "fail_step": r["fail_at"],
                    "lost_steps": r["fail_at"] - lv["step"],
                    "restore_s": lv["restore_s"],
                    "bitwise": lv["bitwise"],
                    "iter_s": r["iter_s"],
                    "replicated_bytes": r["ledger_replicate_bytes"],
                }
            )
    lost = next(r for r in ranks if r["rank"] == 1)
    ctx.log(
        f"rank 1 lost at step {lost['fail_at']}: "
        + ", ".join(
            f"{n} -> step {lv['step']} ({lost['fail_at'] - lv['step']} steps lost, {lv['restore_s']:.3f} s, "
            f"bitwise {lv['bitwise']})"
            for n, lv in lost["levels"].items()
        )
    )
    # expected lost work: half the interval of the best surviving level, plus its restore
    every = {
        "memory": plan["memory_every"],
        "memory-peer": plan["memory_every"],
        "local": plan["local_every"],
        "remote": plan["remote_every"],
    }
    iter_s = lost["iter_s"]
    by_level = {c["level"]: c for c in costs}
    restore_s = {
        "memory": by_level["memory"]["restore_s"],
        "local": by_level["local"]["restore_s"],
        "remote": by_level["remote"]["restore_s"],
        "memory-peer": lost["levels"]["memory-peer"]["restore_s"],
    }
    save_s = {
        "memory": by_level["memory"]["save_s"],
        "local": by_level["local"]["save_s"],
        "remote": by_level["remote"]["save_s"],
    }
    for stack_name, stack in STACKS.items():
        overhead = sum(save_s[lv] / every[lv] for lv in stack if lv in save_s) / iter_s
        for failure, survivors in FAILURES.items():
            best = expected_loss(stack, survivors, every, iter_s, restore_s)
            rows.append(
                {
                    "part": "expected loss",
                    "stack": stack_name,
                    "failure": failure,
                    "level_used": best[1] if best else "none: restart from scratch",
                    "expected_lost_s": best[0] if best else None,
                    "expected_lost_steps": (best[0] / iter_s) if best else None,
                    "save_cost_per_step_fraction": overhead,
                }
            )
    peer_row = lost["levels"]["memory-peer"]
    headline = [
        f"per level, {state_mb:.0f} MB model+AdamW state: "
        + "; ".join(
            f"{c['level']} save {c['save_s'] * 1e3:.0f} ms, restore {c['restore_s'] * 1e3:.0f} ms" for c in costs
        )
        + " (remote is a second directory on the same disk here)",
        f"rank loss at step {lost['fail_at']} of a 2-rank gloo job (memory every {plan['memory_every']} with peer "
        f"copy, local every {plan['local_every']}, remote every {plan['remote_every']}): the peer copy restored rank 1 "
        f"to step {peer_row['step']} ({lost['fail_at'] - peer_row['step']} steps lost, "
        f"{peer_row['restore_s'] * 1e3:.0f}"
        f" ms, bitwise {'identical' if peer_row['bitwise'] else 'DIFFERENT'}); local would lose "
        f"{lost['fail_at'] - lost['levels']['local']['step']} steps, remote "
        f"{lost['fail_at'] - lost['levels']['remote']['step']}",
    ]
    for failure in FAILURES:
        cells = [r for r in rows if r.get("failure") == failure]
        headline.append(
            f"{failure}: expected loss "
            + ", ".join(
                f"{r['stack']} {r['expected_lost_s']:.2f} s ({r['expected_lost_steps']:.1f} steps, {r['level_used']})"
                if r["expected_lost_s"] is not None
                else f"{r['stack']}: no level survives, restart from step 0"
                for r in cells
            )
        )
    overheads = {r["stack"]: r["save_cost_per_step_fraction"] for r in rows if r.get("part") == "expected loss"}
    headline.append(
        f"save cost per training step at these intervals (measured step {iter_s * 1e3:.0f} ms; memory "
        "and peer copies synchronous, disk levels counted at their full synchronous cost, an upper "
        "bound since they persist in the background): " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in overheads.items())
    )
    return {
        "rows": rows,
        "headline": headline,
        "plot": _plot,
        "plan": plan,
        "interconnect": ["loopback gloo between 2 processes on one 2-core machine (peer copies)"],
        "baseline": ["a single local-disk level at the same interval ('local only' stack), same run"],
    }
