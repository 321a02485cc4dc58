"""shuffle-bn (SOTA-364): does batch norm leak the answer in contrastive pretraining on digits?

Quality, in one process: a momentum-encoder contrastive pretraining (MoCo-style: a query encoder
trained by a symmetric InfoNCE loss against keys from its moving average, negatives the other keys
of the global batch) on two augmented views of each sklearn digit. The global batch stands for G
data-parallel workers of B/G pairs each, and batch norm is computed as those workers would:
  local-bn     queries and keys normalised per worker: a pair's query and key share the sub-batch,
               so its statistics can mark the positive (the leak);
  shuffled-bn  queries per worker, keys per dealt group (islands.parallel.shuffle_bn, the single
               process form; the tests check it equals the cross-rank form exactly);
  global-bn    one set of statistics over the whole global batch (synchronised BN);
  layernorm    no batch statistics at all (the reference without any leak).
Downstream: a logistic-regression probe on the frozen backbone's features of the unaugmented
images (train split -> held-out split). Leak diagnostic: the held-out contrastive loss with the key
grouping each run trained with, minus the same loss with dealt key groups; a model that reads the
statistics loses that advantage when they are dealt.
Cost, on 2 gloo ranks (loopback): bytes and time of one key encoding, shuffled vs local.
"""

from __future__ import annotations

import json
import statistics
import sys

from islands_bench.harness import BenchContext, experiment
from islands_bench.spawn import join_world, run_module_ranks, time_interleaved

CONDITIONS = ("local-bn", "shuffled-bn", "global-bn", "layernorm")
HIDDEN, EMBED = 128, 64
TEMPERATURE = 0.2  # MoCo v2's InfoNCE temperature
MOMENTUM = 0.99  # key encoder's moving average (MoCo's 0.999 assumes far longer runs)


def _encoder(norm: str):
    from torch import nn

    def layer(i, o):
        return [nn.Linear(i, o), nn.BatchNorm1d(o) if norm == "bn" else nn.LayerNorm(o), nn.ReLU()]

    backbone = nn.Sequential(*layer(64, HIDDEN), *layer(HIDDEN, HIDDEN))
    head = nn.Sequential(*layer(HIDDEN, HIDDEN), nn.Linear(HIDDEN, EMBED))
    return nn.ModuleDict({"backbone": backbone, "head": head})


def _augment(x, gen):
    """One random view of each 8x8 image: shift by up to one pixel, rescale intensity, drop a
    quarter of the pixels, add noise. Our own choices for images this small."""
    import torch
    import torch.nn.functional as F

    n = x.shape[0]
    img = F.pad(x.view(n, 8, 8), (1, 1, 1, 1))
    dy, dx = (torch.randint(0, 3, (n,), generator=gen) for _ in range(2))
    rows = (dy[:, None] + torch.arange(8))[:, :, None].expand(n, 8, 8)
    cols = (dx[:, None] + torch.arange(8))[:, None, :].expand(n, 8, 8)
    out = img[torch.arange(n)[:, None, None], rows, cols].reshape(n, 64)
    out = out * (0.7 + 0.6 * torch.rand(n, 1, generator=gen))
    out = out * (torch.rand(n, 64, generator=gen) > 0.25)
    return out + 0.1 * torch.randn(n, 64, generator=gen)


def _info_nce(q, k):
    import torch
    import torch.nn.functional as F

    q, k = F.normalize(q, dim=1), F.normalize(k, dim=1)
    return F.cross_entropy(q @ k.T / TEMPERATURE, torch.arange(q.shape[0]))


def _encode(model, x, workers: int, key_gen=None):
    """Query/key embeddings with batch norm over `workers` contiguous sub-batches, or over dealt
    groups when key_gen is given (shuffled keys)."""
    from islands.parallel import encode_in_groups, shuffled_group_encode

    def net(v):
        return model["head"](model["backbone"](v))

    if key_gen is not None:
        return shuffled_group_encode(net, x, workers, key_gen)
    return encode_in_groups(net, x, workers)


def _losses(query, key, v1, v2, workers, key_workers, key_gen):
    q1, q2 = _encode(query, v1, workers), _encode(query, v2, workers)
    k1, k2 = (_encode(key, v, key_workers, key_gen) for v in (v1, v2))
    return 0.5 * (_info_nce(q1, k2) + _info_nce(q2, k1))


def _groupings(condition: str, workers: int):
    """(query sub-batches, key sub-batches, keys dealt?) for a condition."""
    if condition == "global-bn" or condition == "layernorm":
        return 1, 1, False
    return workers, workers, condition == "shuffled-bn"


def _probe(model, digits, per_class: int = 10, draws: int = 5) -> tuple[float, float]:
    """Held-out accuracy of a logistic-regression probe on frozen backbone features: trained on all
    train-split labels, and on `per_class` labels per digit (mean of `draws` fixed draws), where
    the probe relies more on the features and less on its own fit."""
    import numpy as np
    import torch
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    model.eval()
    with torch.no_grad():
        tr = model["backbone"](torch.from_numpy(digits.x_train)).numpy()
        va = model["backbone"](torch.from_numpy(digits.x_val)).numpy()
    model.train()

    def fit(idx):
        scale = StandardScaler().fit(tr[idx])
        clf = LogisticRegression(max_iter=3000).fit(scale.transform(tr[idx]), digits.y_train[idx])
        return float(clf.score(scale.transform(va), digits.y_val))

    full = fit(np.arange(len(tr)))
    few = []
    for d in range(draws):
        rng = np.random.default_rng(d)  # the same labelled subsets for every run
        few.append(
            fit(
                np.concatenate(
                    [rng.choice(np.flatnonzero(digits.y_train == c), per_class, replace=False) for c in range(10)]
                )
            )
        )
    return full, float(np.mean(few))


def pretrain(condition: str, seed: int, steps: int, batch: int, workers: int, digits) -> dict:
    import copy

    import torch

    torch.manual_seed(seed)
    data_gen = torch.Generator().manual_seed(10_000 + seed)
    key_gen = torch.Generator().manual_seed(20_000 + seed)
    query = _encoder("ln" if condition == "layernorm" else "bn")
    key = copy.deepcopy(query).requires_grad_(False)
    opt = torch.optim.AdamW(query.parameters(), lr=1e-3, weight_decay=1e-4)
    qw, kw, dealt = _groupings(condition, workers)
    x_train = torch.from_numpy(digits.x_train)
    losses = []
    for _ in range(steps):
        x = x_train[torch.randint(len(x_train), (batch,), generator=data_gen)]
        v1, v2 = _augment(x, data_gen), _augment(x, data_gen)
        with torch.no_grad():
            for pk, pq in zip(key.parameters(), query.parameters()):
                pk.mul_(MOMENTUM).add_(pq.detach(), alpha=1 - MOMENTUM)
        loss = _losses(query, key, v1, v2, qw, kw, key_gen if dealt else None)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # held-out contrastive loss with batch statistics as in training; then the leak gap: queries per
    # worker, keys in the query's own sub-batch vs dealt (zero for a model that cannot read statistics)
    val_gen = torch.Generator().manual_seed(30_000)
    x = torch.from_numpy(digits.x_val[: (len(digits.x_val) // workers) * workers])
    v1, v2 = _augment(x, val_gen), _augment(x, val_gen)
    with torch.no_grad():
        as_trained = _losses(query, key, v1, v2, qw, kw, torch.Generator().manual_seed(1) if dealt else None).item()
        same_sub_batch = _losses(query, key, v1, v2, workers, workers, None).item()
        keys_dealt = _losses(query, key, v1, v2, workers, workers, torch.Generator().manual_seed(1)).item()
    tail = max(1, steps // 10)
    return {
        "condition": condition,
        "seed": seed,
        "train_loss": statistics.fmean(losses[-tail:]),
        "val_loss": as_trained,
        "leak_gap": keys_dealt - same_sub_batch,
        **dict(zip(("probe_acc", "probe_acc_10_per_class"), _probe(query, digits))),
    }


def _worker(out_path: str, rows: int, reps: int, rate: str) -> None:
    """One rank of the cost part: one no-grad key encoding of `rows` rows, local vs shuffled."""
    import torch

    from islands import close_world
    from islands.measure import describe
    from islands.parallel import shuffled_encode, shuffled_encode_bytes

    world, inter = join_world(rate)
    comm = world.comm("global")
    torch.manual_seed(0)
    enc = _encoder("bn")

    def net(v):
        return enc["head"](enc["backbone"](v))

    x = torch.rand(rows, 64, generator=torch.Generator().manual_seed(world.rank))
    gen = torch.Generator().manual_seed(7)
    ops = {"local": lambda: net(x), "shuffled": lambda: shuffled_encode(net, x, comm, gen)}
    with torch.no_grad():
        world.ledger.reset()
        ops["shuffled"]()
        sent, received = world.ledger.total_sent, world.ledger.total_received
        seconds = time_interleaved(ops, reps)
    want = shuffled_encode_bytes(rows, (64,), (EMBED,), world.size)
    if world.rank == 0:
        with open(out_path, "w") as f:
            json.dump(
                {
                    "rows": rows,
                    "ranks": world.size,
                    "sent": sent,
                    "received": received,
                    "expected": want,
                    "ms_local": 1000 * seconds["local"],
                    "ms_shuffled": 1000 * seconds["shuffled"],
                    "interconnect_line": describe(inter),
                },
                f,
            )
    close_world(world)


def _mean(rows: list[dict], condition: str, key: str) -> float:
    return statistics.fmean(r[key] for r in rows if r.get("condition") == condition)


@experiment(
    "shuffle-bn",
    practices=("SOTA-364",),
    help="contrastive pretraining on digits: per-worker vs shuffled vs global batch norm vs layernorm, "
    "linear-probe accuracy and the batch-statistics leak; cost of the cross-rank shuffle",
)
def shuffle_bn(ctx: BenchContext) -> dict:
    import torch

    from islands.data import load_digits

    rows_per_rank = 64
    cost = run_module_ranks(
        "islands_bench.experiments.shuffle_bn",
        [str(rows_per_rank), "2" if ctx.smoke else "10" if ctx.quick else "30"],
        2,
        ctx.out_dir / "cost.json",
    )
    ctx.log(f"cost: {cost}")
    steps, seeds = (2, (0,)) if ctx.smoke else (250, (0, 1)) if ctx.quick else (600, (0, 1, 2, 3, 4))
    batch, workers = 128, 8
    digits = load_digits()
    rows = []
    # tiny per-group matmuls: one thread, or a loaded machine spends the run in thread hand-offs
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for seed in seeds:
        for condition in CONDITIONS:
            r = pretrain(condition, seed, steps, batch, workers, digits)
            ctx.log(
                f"seed {seed} {condition}: " + ", ".join(f"{k} {v:.4f}" for k, v in r.items() if isinstance(v, float))
            )
            rows.append(
                {
                    "part": "quality",
                    **{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()},
                    "steps": steps,
                    "batch": batch,
                    "workers": workers,
                    "interconnect": "in-process",
                }
            )
    torch.set_num_threads(threads)
    rows.append(
        {
            "part": "cost",
            "rows_per_rank": cost["rows"],
            "ranks": cost["ranks"],
            "sent": cost["sent"],
            "received": cost["received"],
            "ms_local": round(cost["ms_local"], 3),
            "ms_shuffled": round(cost["ms_shuffled"], 3),
            "interconnect": cost["interconnect_line"],
        }
    )
    q = [r for r in rows if r["part"] == "quality"]
    summary = "; ".join(
        f"{c} {_mean(q, c, 'probe_acc'):.4f} / {_mean(q, c, 'probe_acc_10_per_class'):.4f}" for c in CONDITIONS
    )

    def paired(key):
        """shuffled-bn minus local-bn, seed by seed (same data, views and initial weights)."""
        d = [
            next(r[key] for r in q if r["condition"] == "shuffled-bn" and r["seed"] == s)
            - next(r[key] for r in q if r["condition"] == "local-bn" and r["seed"] == s)
            for s in seeds
        ]
        spread = f" (seeds {min(d):+.4f}..{max(d):+.4f})" if len(d) > 1 else ""
        return f"{statistics.fmean(d):+.4f}{spread}"

    headline = [
        f"digits, momentum-encoder InfoNCE, {steps} steps, global batch {batch} as {workers} workers of "
        f"{batch // workers}, mean of {len(seeds)} seeds; held-out linear-probe accuracy (all labels / 10 per class): "
        + summary,
        "final training loss (lower with a leak): "
        + "; ".join(f"{c} {_mean(q, c, 'train_loss'):.3f}" for c in CONDITIONS)
        + "; leak gap (held-out loss rise when keys leave the query's sub-batch): "
        + "; ".join(f"{c} {_mean(q, c, 'leak_gap'):+.3f}" for c in CONDITIONS),
        f"shuffled-bn minus local-bn, paired by seed: probe accuracy {paired('probe_acc')}, 10 per class "
        f"{paired('probe_acc_10_per_class')}, final training loss {paired('train_loss')}",
        f"{cost['interconnect_line']}, 2 ranks x {cost['rows']} key rows: a shuffled key encoding sends "
        f"{cost['sent']:,} B per rank (formula {cost['expected']['sent']:,}) and takes {cost['ms_shuffled']:.2f} ms vs "
        f"{cost['ms_local']:.2f} ms local",
    ]
    return {
        "rows": rows,
        "headline": headline,
        "interconnect": [
            "quality: in-process (the G workers emulated in one process, no link)",
            f"cost: {cost['interconnect_line']}",
        ],
        "baseline": [
            "local-bn: per-worker batch norm, each worker's queries and keys in one sub-batch (the "
            "ordinary data-parallel BN, where the leak exists); same data, views, seeds and steps for "
            "every condition; cost baseline: the same key encoding on each rank alone"
        ],
    }


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
