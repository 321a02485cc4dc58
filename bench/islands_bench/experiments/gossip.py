"""gossip (SOTA-223, SOTA-225, SOTA-226): decentralised gossip against all-reduce averaging.

Three parts, measured side by side in one invocation:
  mixing    consensus distance vs rounds for ring / exponential graph / fresh random peers, pure
            mixing in one process (islands.sync.outer.simulate_mixing: the strategy's own
            arithmetic), averaged over seeds; distance relative to the starting one.
  training  digits, workers = islands (8 quick): gossip(exp), gossip(ring), gossip(random:s=1) and
            local-sgd (all-reduce) at the same H. Every run writes one checkpoint per rank at its last
            step; each node's own final model is evaluated here, and the consensus distance of the
            nodes' parameters is computed from those checkpoints (outside training traffic).
  link      seconds per step, local-sgd (all-reduce) vs gossip, H = 1, on loopback and on a real
            tc-shaped testbed link (one host per worker), to find where dropping the global average
            pays (SOTA-225). A wider digits MLP makes the exchange big enough for the link to matter.
"""

from __future__ import annotations

import math
import os

import torch

from islands_bench.harness import BenchContext, experiment
from islands_bench.plots import figure

TOPOLOGIES = ["ring", "exp", "random:s=1", "random:s=2"]
VECTORS_PER_ROUND = {"ring": 2, "exp": 1, "random:s=1": 1, "random:s=2": 2}  # sent per node per round
REL_TARGET = 1e-3  # "agreed" = consensus distance below 0.1% of the starting one


# ---- part 1: pure mixing --------------------------------------------------------------------------
def mixing_rows(n: int, rounds: int, seeds: int, dim: int = 64) -> tuple[list[dict], dict]:
    from islands.sync.outer import parse_topology, simulate_mixing

    rows, curves = [], {}
    for spec in TOPOLOGIES:
        per_seed = []
        for seed in range(seeds):
            g = torch.Generator().manual_seed(seed)
            xs = [torch.randn(dim, generator=g) for _ in range(n)]
            dists, _ = simulate_mixing(parse_topology(spec, seed=seed), xs, rounds)
            per_seed.append([d / dists[0] for d in dists])
        curve = [sum(c[t] for c in per_seed) / seeds for t in range(rounds + 1)]
        curves[f"n={n} {spec}"] = curve
        hit = next((t for t, d in enumerate(curve) if d <= REL_TARGET), None)
        log_n = math.ceil(math.log2(n))
        rows.append(
            {
                "part": "mixing",
                "run": f"n={n} {spec}",
                "nodes": n,
                "topology": spec,
                "vectors_per_node_per_round": VECTORS_PER_ROUND[spec],
                "rel_distance_after_log2n_rounds": curve[log_n],
                "rounds_to_0.1pct": hit,
                "vectors_to_0.1pct": hit * VECTORS_PER_ROUND[spec] if hit is not None else None,
            }
        )
    return rows, curves


# ---- part 2: training on digits -------------------------------------------------------------------
def _node_models(ctx: BenchContext, label: str, workers: int) -> list[dict]:
    """Each rank's final checkpoint tree (model = that node's own model, strategy.outer.global = its params)."""
    from islands.checkpoint import CheckpointStore

    root = ctx.out_dir / "runs" / label / "ckpt"  # the job's checkpoint directory (checkpoint.dir "" = RUN_DIR/ckpt)
    if not root.is_dir():
        raise RuntimeError(f"no checkpoint under {root}; did ckpt_every reach the last step?")
    return [
        CheckpointStore(root, rank=r, world_size=workers, barrier=lambda: None, clean=False).load().tree
        for r in range(workers)
    ]


def training_rows(ctx: BenchContext, workers: int, steps: int, h: int) -> list[dict]:
    from islands import evaluate
    from islands.app.build import build_task
    from islands.sync.outer import consensus_distance

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
    runs = [
        ("local-sgd", f"local-sgd:every={h}"),
        ("gossip-exp", f"gossip:every={h},topology=exp"),
        ("gossip-ring", f"gossip:every={h},topology=ring"),
        ("gossip-random-s1", f"gossip:every={h},topology=random:s=1"),
    ]
    task = build_task(ctx.config(**{**base, "workers": 1, "islands": 1}))  # the val set and a model to load into
    rows = []
    for label, spec in runs:
        rec = ctx.train(label, outer=spec, **base)
        trees = _node_models(ctx, label, workers)
        losses = []
        for tree in trees:
            task.model.load_state_dict(tree["model"])
            losses.append(evaluate(task.model, task.val_data, task.loss_fn, torch.device("cpu"))["val_loss"])
        flats = [tree["strategy"]["outer"]["global"] for tree in trees]  # Stack(inner, outer) state
        ledgers = rec["comm"]["per_rank"]
        sent = [led["sent"].get("outer_params", 0) for led in ledgers]
        calls = [led["calls"].get("outer_params", 0) for led in ledgers]
        payload = sum(sent) / max(sum(calls), 1)  # per node per sync, averaged over ranks
        # gloo's ring all-reduce puts 2(n-1)/n payloads on each node's link; a p2p send puts one
        wire = payload * (2 * (workers - 1) / workers if spec.startswith("local-sgd") else 1.0)
        s = rec["summary"]
        rows.append(
            {
                "part": "training",
                "run": label,
                "spec": spec,
                "nodes": workers,
                "H": h,
                "final_val_loss": s["final_val_loss"],
                "node_val_loss_mean": sum(losses) / len(losses),
                "node_val_loss_max": max(losses),
                "consensus_distance": consensus_distance(flats),
                "param_norm": float(torch.stack(flats).mean(0).norm()),
                "bytes_per_node_per_sync": payload,
                "wire_bytes_per_node_per_sync": wire,
                "syncs": max(calls),
                "s_per_step": s["seconds_per_step"],
                "interconnect": rec["interconnect_line"],
            }
        )
    return rows


# ---- part 3: step time on a shaped link (SOTA-225) ------------------------------------------------
def link_rows(ctx: BenchContext, rates: list[str], workers: int, steps: int, hidden: int) -> list[dict]:
    base = dict(
        task="digits",
        hidden=hidden,
        steps=steps,
        global_batch=8 * workers,
        warmup=1,
        eval_every=0,
        workers=workers,
        islands=workers,
        log_every=steps,
    )  # probe on: each record names its link
    runs = [
        ("all-reduce", "local-sgd:every=1"),
        ("gossip-exp", "gossip:every=1,topology=exp"),
        ("gossip-ring", "gossip:every=1,topology=ring"),
    ]
    rows = []
    for rate in rates:

        def one(label, spec, bed=None, *, rate=rate):
            extra = {"testbed": bed.name} if bed is not None else {}
            rec = ctx.train(f"link-{rate}-{label}", outer=spec, **extra, **base)
            s = rec["summary"]
            sent = rec["comm"]["per_rank"][0]["sent"].get("outer_params", 0) / s["steps"]
            wire = sent * (2 * (workers - 1) / workers if spec.startswith("local-sgd") else 1.0)
            blocked = s["sync_blocked_seconds"] / s["steps"]
            rows.append(
                {
                    "part": "link",
                    "run": f"{rate} {label}",
                    "link": rate,
                    "spec": spec,
                    "nodes": workers,
                    "s_per_step": s["seconds_per_step"],
                    "blocked_s_per_step": s["sync_blocked_seconds"] / s["steps"],
                    "compute_s_per_step": (s["wall_seconds"] - s["sync_blocked_seconds"]) / s["steps"],
                    "bytes_per_node_per_sync": sent,
                    "wire_bytes_per_node_per_sync": wire,
                    # what one node's uplink achieved while the loop was blocked on the exchange
                    "achieved_mbit_per_node": wire * 8 / 1e6 / max(blocked, 1e-9),
                    "interconnect": rec["interconnect_line"],
                }
            )

        if rate == "loopback":
            for label, spec in runs:
                one(label, spec)
        else:
            with ctx.testbed(rate, hosts=workers) as bed:
                for label, spec in runs:
                    one(label, spec, bed)
    return rows


def _plot(result, path):
    with figure(path, 1, 3, figsize=(14, 4)) as (fig, ax):
        for label, curve in result["mixing_curves"].items():
            ax[0].semilogy(range(len(curve)), [max(c, 1e-9) for c in curve], marker="o", ms=3, label=label)
        ax[0].set_xlabel("gossip rounds")
        ax[0].set_ylabel("consensus distance / start (floor 1e-9)")
        ax[0].legend(fontsize=6)
        train = [r for r in result["rows"] if r["part"] == "training"]
        ax[1].bar([r["run"] for r in train], [r["node_val_loss_mean"] for r in train])
        ax[1].set_ylabel("final val loss, mean over nodes' own models")
        ax[1].tick_params(axis="x", rotation=20, labelsize=7)
        link = [r for r in result["rows"] if r["part"] == "link"]
        ax[2].bar([r["run"].replace(" ", "\n") for r in link], [r["s_per_step"] for r in link])
        ax[2].set_ylabel("seconds per step (H = 1)")
        ax[2].tick_params(axis="x", labelsize=6)
        fig.suptitle(f"gossip{' (quick)' if result['quick'] else ''}; {result['interconnect'][-1]}", fontsize=8)


def _rounds(row: dict, curves: dict) -> str:
    hit = row["rounds_to_0.1pct"]
    return str(hit) if hit is not None else f"> {len(curves[row['run']]) - 1}"


@experiment(
    "gossip",
    practices=("SOTA-223", "SOTA-225", "SOTA-226"),
    help="gossip: consensus vs rounds per topology, digits training vs all-reduce local SGD, "
    "step time of all-reduce vs gossip on a tc-shaped link",
)
def gossip(ctx: BenchContext) -> dict:
    quick = ctx.quick
    mix, curves = [], {}
    for n in (8, 16, 12) if quick else (8, 16, 32, 12):
        r, c = mixing_rows(n, rounds=30 if quick else 40, seeds=5 if quick else 20)
        mix += r
        curves.update(c)
    workers = 4 if ctx.smoke else 8
    train = training_rows(ctx, workers=workers, steps=200 if quick else 600, h=4)
    rates = ["loopback", ctx.rate or "50mbit"] if quick else ["loopback", "1gbit", "200mbit", "50mbit", "10mbit"]
    if ctx.smoke:  # 4 nodes; the link part on the testbed only (the training part ran on loopback)
        rates = rates[1:]
    # hidden 512: the digits MLP (64-512-512-10) has 0.3 M parameters, 1.2 MB per exchange
    link = link_rows(ctx, rates, workers=4, steps=12 if quick else 40, hidden=512)
    rows = mix + train + link

    m = {r["run"]: r for r in mix}
    e16, r16, s16 = m["n=16 exp"], m["n=16 ring"], m["n=16 random:s=1"]
    t = {r["run"]: r for r in train}
    ref = t["local-sgd"]
    headline = [
        f"SOTA-226, pure mixing of 16 nodes: the exponential graph agrees exactly after log2(16) = 4 rounds "
        f"(relative distance {e16['rel_distance_after_log2n_rounds']:.1e}, one vector per node per round); the ring "
        f"is at {r16['rel_distance_after_log2n_rounds']:.2f} after 4 rounds with two vectors per round "
        f"(rounds to 0.1%: exp {e16['rounds_to_0.1pct']}, ring {_rounds(r16, curves)}); "
        f"n = 12 (not a power of two) exp needs {m['n=12 exp']['rounds_to_0.1pct']} rounds",
        f"SOTA-223, same bytes per round: fresh random peers s=1 (push-sum) reach 0.1% in "
        f"{s16['rounds_to_0.1pct']} rounds at n=16 vs exp {e16['rounds_to_0.1pct']}; random s=2 "
        f"{m['n=16 random:s=2']['rounds_to_0.1pct']} vs ring {_rounds(r16, curves)} (pure consensus, no training)",
        f"training, digits, {workers} nodes (islands = workers), H=4: mean over nodes of each node's own final val "
        "loss "
        + ", ".join(
            f"{r['run']} {r['node_val_loss_mean']:.4f} (consensus distance {r['consensus_distance']:.3g})"
            for r in train
        )
        + f"; payload per node per sync: all-reduce {ref['bytes_per_node_per_sync']:,.0f} B "
        f"(~{ref['wire_bytes_per_node_per_sync']:,.0f} B on the wire for a ring all-reduce), "
        f"gossip exp {t['gossip-exp']['bytes_per_node_per_sync']:,.0f} B, ring "
        f"{t['gossip-ring']['bytes_per_node_per_sync']:,.0f} B",
    ]
    for rate in rates:
        lr = {r["run"].split(" ", 1)[1]: r for r in link if r["link"] == rate}
        ar, ge, gr = lr["all-reduce"], lr["gossip-exp"], lr["gossip-ring"]
        headline.append(
            f"SOTA-225, {rate}, 4 nodes, H=1, {ar['bytes_per_node_per_sync'] / 1e6:.2f} MB payload per node per "
            f"all-reduce: all-reduce {ar['s_per_step']:.3f} s/step (blocked {ar['blocked_s_per_step']:.3f}), "
            f"gossip exp {ge['s_per_step']:.3f} ({ar['s_per_step'] / ge['s_per_step']:.2f}x), "
            f"gossip ring {gr['s_per_step']:.3f} ({ar['s_per_step'] / gr['s_per_step']:.2f}x); achieved uplink while "
            f"blocked: all-reduce {ar['achieved_mbit_per_node']:.0f}, exp {ge['achieved_mbit_per_node']:.0f}, ring "
            f"{gr['achieved_mbit_per_node']:.0f} Mbit/s; {ar['interconnect']}"
        )
    headline.append(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
        + ("quick: 2 links, few steps; the full run sweeps 5 links" if quick else "full sweep")
    )
    return {"rows": rows, "headline": headline, "plot": _plot, "mixing_curves": curves, "rel_target": REL_TARGET}
