"""pair-loss (SOTA-376): per-pair sigmoid loss on a ring vs softmax over an all-gathered batch.

Two parts, side by side in one invocation:
- cost: 2 ranks, random unit embeddings; per rank and step the bytes sent, the held activation bytes
  (saved-tensor hooks) and the step time, sigmoid ring vs gathered softmax, on loopback;
- quality: two towers trained in one process on paired views of a random latent (one direct, one
  through a fixed nonlinear mixing plus noise) with each loss at several batch sizes; top-1
  retrieval of the matching view among 1000 held-out pairs. One process computes exactly what the ranks would (the tests
  check the distributed losses against the whole-batch ones).
"""

from __future__ import annotations

import json
import math
import sys

from islands_bench.harness import BenchContext, experiment
from islands_bench.spawn import held_bytes, join_world, run_module_ranks, time_interleaved

DIM = 128
HELD_OUT = 1000  # pairs in the retrieval test


def _worker(out_path: str, sizes: list[int], reps: int, rate: str) -> None:
    import torch
    import torch.nn.functional as F

    from islands import close_world
    from islands.measure import describe
    from islands.parallel import sigmoid_pair_loss, softmax_pair_loss

    world, inter = join_world(rate)
    comm = world.comm("global")
    rows = []
    for b in sizes:
        g = torch.Generator().manual_seed(world.rank)
        x0 = F.normalize(torch.randn(b, DIM, generator=g), dim=1)
        y0 = F.normalize(torch.randn(b, DIM, generator=g), dim=1)
        t, bias = torch.tensor(2.3, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
        losses = {
            "sigmoid-ring": lambda x, y, t=t, bias=bias: sigmoid_pair_loss(x, y, t, bias, comm),
            "softmax-gather": lambda x, y, t=t: softmax_pair_loss(x, y, t, comm),
        }

        def step(name, *, x0=x0, y0=y0, losses=losses):
            x, y = x0.clone().requires_grad_(True), y0.clone().requires_grad_(True)
            losses[name](x, y).backward()

        row = {"batch_per_rank": b}
        for name in losses:
            sent0 = world.ledger.total_sent
            row[f"held_{name}"] = held_bytes(lambda name=name: step(name))
            row[f"sent_{name}"] = world.ledger.total_sent - sent0
        seconds = time_interleaved({name: (lambda name=name: step(name)) for name in losses}, reps)
        row.update({f"ms_{name}": 1000 * v for name, v in seconds.items()})
        rows.append(row)
    if world.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"rows": rows, "interconnect_line": describe(inter)}, f)
    close_world(world)


def _pairs(n: int, gen, mix):
    """Paired views of one latent: x sees it directly, y through a fixed random mixing plus noise."""
    import torch

    z = torch.randn(n, mix.shape[0], generator=gen)
    return z, torch.tanh(z @ mix) + 0.3 * torch.randn(n, mix.shape[1], generator=gen)


def _quality(batch: int, loss_name: str, steps: int, seed: int = 0) -> float:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from islands.parallel import sigmoid_pair_loss, softmax_pair_loss

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    mix = torch.randn(32, 32, generator=gen) / 32**0.5
    towers = [nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 32)) for _ in range(2)]
    # sigmoid: t = 10 and a bias at the prior log-odds of a pair being positive, -ln(batch) (LIT-605
    # starts at -10 for its 32k batches: the same prior at that size); softmax: CLIP's t = 1/0.07
    t = torch.tensor(2.303 if loss_name == "sigmoid" else 2.659, requires_grad=True)
    b = torch.tensor(-math.log(batch), requires_grad=True)
    params = [p for tw in towers for p in tw.parameters()] + [t, b]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=1e-4)
    for _ in range(steps):
        u, v = _pairs(batch, gen, mix)
        x, y = F.normalize(towers[0](u), dim=1), F.normalize(towers[1](v), dim=1)
        loss = sigmoid_pair_loss(x, y, t, b) if loss_name == "sigmoid" else softmax_pair_loss(x, y, t)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        u, v = _pairs(HELD_OUT, torch.Generator().manual_seed(1234), mix)
        x, y = F.normalize(towers[0](u), dim=1), F.normalize(towers[1](v), dim=1)
        return float((x @ y.T).argmax(1).eq(torch.arange(HELD_OUT)).float().mean())


@experiment(
    "pair-loss",
    practices=("SOTA-376",),
    help="sigmoid pair loss on a ring vs all-gathered softmax: bytes, held memory, time, retrieval accuracy",
)
def pair_loss(ctx: BenchContext) -> dict:
    sizes = [128] if ctx.smoke else [128, 512] if ctx.quick else [256, 1024, 4096]
    reps = "1" if ctx.smoke else "5" if ctx.quick else "15"
    res = run_module_ranks(
        "islands_bench.experiments.pair_loss", [json.dumps(sizes), reps], 2, ctx.out_dir / "cost.json"
    )
    rows = []
    for r in res["rows"]:
        rows.append(
            {
                "part": "cost",
                "batch_per_rank": r["batch_per_rank"],
                **{k: (round(v, 2) if k.startswith("ms_") else v) for k, v in r.items() if k != "batch_per_rank"},
                "interconnect": res["interconnect_line"],
            }
        )
    steps = 10 if ctx.smoke else 300 if ctx.quick else 1000
    batches = (32,) if ctx.smoke else (32, 128) if ctx.quick else (32, 128, 512)
    for batch in batches:
        acc = {name: _quality(batch, name, steps) for name in ("sigmoid", "softmax")}
        ctx.log(f"batch {batch}: retrieval top-1 {acc}")
        rows.append(
            {
                "part": "quality",
                "batch": batch,
                "steps": steps,
                "top1_sigmoid": round(acc["sigmoid"], 4),
                "top1_softmax": round(acc["softmax"], 4),
            }
        )
    big = next(r for r in rows if r["part"] == "cost" and r["batch_per_rank"] == max(sizes))
    qual = [r for r in rows if r["part"] == "quality"]
    headline = [
        f"{res['interconnect_line']}, 2 ranks x {big['batch_per_rank']} pairs, d={DIM}: the sigmoid ring holds "
        f"{big['held_sigmoid-ring']:,} B of activations per rank vs {big['held_softmax-gather']:,} B for the gathered "
        f"softmax ({big['held_softmax-gather'] / big['held_sigmoid-ring']:.1f}x less) and sends "
        f"{big['sent_sigmoid-ring']:,} vs {big['sent_softmax-gather']:,} B per step; step "
        f"{big['ms_sigmoid-ring']:.1f} vs {big['ms_softmax-gather']:.1f} ms",
        f"paired-view retrieval (top-1 match among {HELD_OUT} held-out pairs; one process, {steps} steps): "
        + "; ".join(
            f"batch {r['batch']}: sigmoid {r['top1_sigmoid']:.3f} vs softmax {r['top1_softmax']:.3f}" for r in qual
        ),
    ]
    return {
        "rows": rows,
        "headline": headline,
        "interconnect": [res["interconnect_line"]],
        "baseline": [
            "softmax (InfoNCE, both directions) over the all-gathered batch, same ranks, same inputs, "
            "interleaved; quality: the same towers, data, views, optimizer and steps with each loss"
        ],
    }


if __name__ == "__main__":
    _worker(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
