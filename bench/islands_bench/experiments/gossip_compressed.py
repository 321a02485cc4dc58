"""gossip-compressed (SOTA-920): gossip whose messages are compressed against per-edge estimates (CHOCO, LIT-920).

Two parts, side by side in one invocation:
  mixing    pure consensus in one process with the strategy's own arithmetic (islands.sync.outer.simulate_mixing):
            uncompressed gossip against compressed gossip at several consensus steps gamma, on the ring and the
            exponential graph; rounds and bytes per node until the consensus distance is 1% of the start.
  training  digits, 4 nodes (islands = workers), H = 4: uncompressed gossip (exp), compressed gossip (exp, top-k
            with few-bit values) at two gammas, and all-reduce local SGD as the reference; the mean over nodes of
            each node's own final validation loss, and the bytes each node sends per gossip round.
"""

from __future__ import annotations

import os

import torch

from islands_bench.experiments.gossip import _node_models
from islands_bench.harness import BenchContext, experiment
from islands_bench.plots import figure

TARGET = 1e-2  # "agreed" = consensus distance at 1% of the starting one


def _rounds_to(curve: list[float], target: float) -> int | None:
    return next((t for t, d in enumerate(curve) if d <= target * curve[0]), None)


def mixing_rows(n: int, dim: int, rounds: int, seeds: int) -> tuple[list[dict], dict]:
    from islands.compress import TopKQ
    from islands.sync.outer import parse_topology, simulate_mixing

    arms = [("dense", None, 1.0)]
    for ratio, bits in ((0.05, 8), (0.01, 2)):
        for gamma in (0.1, 0.3, 1.0) if bits == 8 else (0.05, 0.1, 0.3):
            arms.append((f"topkq {ratio:g}/{bits}b gamma {gamma:g}", TopKQ(ratio=ratio, bits=bits), gamma))
    rows, curves = [], {}
    for topo in ("ring", "exp"):
        for label, comp, gamma in arms:
            per_seed, nbytes = [], dim * 4
            for seed in range(seeds):
                g = torch.Generator().manual_seed(seed)
                xs = [torch.randn(dim, generator=g) for _ in range(n)]
                dists, _ = simulate_mixing(parse_topology(topo), xs, rounds, compressor=comp, gamma=gamma)
                per_seed.append([d / dists[0] for d in dists])
                if comp is not None:
                    nbytes = comp.payload_nbytes((dim,), torch.float32)
            curve = [sum(c[t] for c in per_seed) / seeds for t in range(rounds + 1)]
            curves[f"{topo} {label}"] = curve
            hit = _rounds_to(curve, TARGET)
            per_round = nbytes * (2 if topo == "ring" and n > 2 else 1)
            rows.append(
                {
                    "part": "mixing",
                    "run": f"{topo} {label}",
                    "topology": topo,
                    "nodes": n,
                    "dim": dim,
                    "gamma": gamma,
                    "bytes_per_node_per_round": per_round,
                    "rel_distance_end": curve[-1],
                    "rounds_to_1pct": hit,
                    "bytes_per_node_to_1pct": hit * per_round if hit is not None else None,
                }
            )
    return rows, curves


def training_rows(ctx: BenchContext, workers: int, steps: int, h: int) -> list[dict]:
    from islands import evaluate
    from islands.app.build import build_task

    base = dict(
        task="digits",
        steps=steps,
        global_batch=8 * workers,
        warmup=max(steps // 10, 1),
        eval_every=0,
        workers=workers,
        islands=workers,
        log_every=max(steps // 10, 1),
        ckpt_every=steps,
    )
    comp = "compressor=(topkq:ratio=0.05,bits=4)"
    runs = [
        ("local-sgd", f"local-sgd:every={h}"),
        ("gossip-exp", f"gossip:every={h},topology=exp"),
        ("choco-exp-g0.3", f"gossip:every={h},topology=exp,{comp},gamma=0.3"),
        ("choco-exp-g0.1", f"gossip:every={h},topology=exp,{comp},gamma=0.1"),
    ]
    if ctx.smoke:  # gossip and compressed gossip (the headline's pair)
        runs = runs[1:3]
    ctx.plan(len(runs))
    task = build_task(ctx.config(**{**base, "workers": 1, "islands": 1}))
    rows = []
    for label, spec in runs:
        rec = ctx.train(label, outer=spec, **base)
        losses = []
        for tree in _node_models(ctx, label, workers):
            task.model.load_state_dict(tree["model"])
            losses.append(evaluate(task.model, task.val_data, task.loss_fn, torch.device("cpu"))["val_loss"])
        ledger = rec["comm"]["per_rank"][0]
        calls = ledger["calls"].get("outer_params", 0)
        rows.append(
            {
                "part": "training",
                "run": label,
                "spec": spec,
                "nodes": workers,
                "H": h,
                "final_val_loss": rec["summary"]["final_val_loss"],
                "node_val_loss_mean": sum(losses) / len(losses),
                "node_val_loss_max": max(losses),
                "bytes_per_node_per_sync": ledger["sent"].get("outer_params", 0) / max(calls, 1),
                "syncs": calls,
                "interconnect": rec["interconnect_line"],
            }
        )
    return rows


def _plot(result, path):
    with figure(path, 1, 2, figsize=(11, 4)) as (fig, ax):
        for label, curve in result["mixing_curves"].items():
            ax[0].semilogy(range(len(curve)), [max(c, 1e-9) for c in curve], label=label)
        ax[0].set_xlabel("gossip rounds")
        ax[0].set_ylabel("consensus distance / start")
        ax[0].legend(fontsize=5)
        train = [r for r in result["rows"] if r["part"] == "training"]
        ax[1].bar([r["run"] for r in train], [r["node_val_loss_mean"] for r in train])
        ax[1].set_ylabel("final val loss, mean over nodes' own models")
        ax[1].tick_params(axis="x", rotation=20, labelsize=7)
        fig.suptitle(
            f"gossip-compressed{' (quick)' if result['quick'] else ''}; {result['interconnect'][-1]}", fontsize=8
        )


@experiment(
    "gossip-compressed",
    practices=("SOTA-920",),
    help="compressed gossip (per-edge estimates, CHOCO): consensus rounds and bytes vs uncompressed gossip, "
    "and digits training of 4 nodes against gossip and all-reduce local SGD",
)
def gossip_compressed(ctx: BenchContext) -> dict:
    quick = ctx.quick
    mix, curves = mixing_rows(
        n=8, dim=4096, rounds=20 if ctx.smoke else 150 if quick else 400, seeds=1 if ctx.smoke else 2 if quick else 5
    )
    train = training_rows(ctx, workers=4, steps=200 if quick else 600, h=4)
    m = {r["run"]: r for r in mix}
    t = {r["run"]: r for r in train}

    def reach(r):
        return (
            f"{r['rounds_to_1pct']} rounds, {r['bytes_per_node_to_1pct'] / 1e3:,.1f} kB/node"
            if r["rounds_to_1pct"] is not None
            else f"not in {len(curves[r['run']]) - 1} rounds (at {r['rel_distance_end']:.2g})"
        )

    headline = []
    for topo in ("ring", "exp"):
        best = min(
            (
                r
                for r in mix
                if r["topology"] == topo and r["rounds_to_1pct"] is not None and r["run"] != f"{topo} dense"
            ),
            key=lambda r: r["bytes_per_node_to_1pct"],
            default=None,
        )
        dense = m[f"{topo} dense"]
        headline.append(
            f"mixing, 8 nodes, {topo}, 4096 values, consensus to 1%: dense {reach(dense)}; "
            + "; ".join(
                f"{r['run'].split(' ', 1)[1]} {reach(r)}"
                for r in mix
                if r["topology"] == topo and r["run"] != f"{topo} dense"
            )
            + (
                f"; fewest bytes: {best['run']} "
                f"({dense['bytes_per_node_to_1pct'] / best['bytes_per_node_to_1pct']:.1f}x "
                f"fewer than dense)"
                if best is not None and dense["bytes_per_node_to_1pct"]
                else ""
            )
        )
    ref = t["gossip-exp"]
    headline.append(
        "training, digits, 4 nodes, H=4 (mean of each node's own final val loss; bytes per node per gossip round): "
        + ", ".join(f"{r['run']} {r['node_val_loss_mean']:.4f} ({r['bytes_per_node_per_sync']:,.0f} B)" for r in train)
        + "; compressed gossip sends "
        f"{ref['bytes_per_node_per_sync'] / max(t['choco-exp-g0.3']['bytes_per_node_per_sync'], 1):.1f}x "
        f"fewer bytes per round than gossip; {ref['interconnect']}"
    )
    headline.append(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    return {"rows": mix + train, "headline": headline, "plot": _plot, "mixing_curves": curves}
