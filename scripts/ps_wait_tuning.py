"""Tune `wait=auto` (ps_wait.PacedWait: its reach and margin) on a virtual clock, where the load of this shared
machine cannot move the answer (issue #36: "wait=auto's reach and margin are untuned").

    PYTHONPATH=src:bench python scripts/ps_wait_tuning.py OUT [--mixes 1/2/4,1/1.5/3,1/1/1] [--jitter 0.1]
        [--reach 0.1,0.2,0.35,0.5,0.75,1.0] [--margin 0,0.1,0.25] [--seeds 0,1]

Three islands of the digits MLP run as threads of one process (islands.simulate) against one in-process server
whose arrivals follow a virtual clock: island i's round of H steps takes t_i virtual seconds times (1 + u), u drawn
uniformly from [-jitter, jitter] per round from a seeded generator (the same draws for every arm of a seed), plus
whatever it waited for held answers. Nothing moves over a link: a remote island's late transfer is not modelled
here (setting (d) on the testbed measures that; it needs the reach above ~0.3, docs/parameter-server.md).

Every arm trains 400 steps per island at H=20, global batch 48 (16 per island), AdamW lr 3e-3 with 10% warm-up and
a cosine decay to 0.1, as the bench's quick tier (`parameter-server --quick`). The target is DDP's validation loss
after 200 steps on the same three data shards (one model, the three batches' mean gradient). Measured for island 0
(the fastest, the bench's rank 0): the virtual time and step of its first round end whose model (the server's
answer) is at or under the target, its final loss, and the server's goodput.

Arms: diloco (synchronous: round k ends when the slowest island's k-th round does); ps (quorum 1, no wait); ps-wait
(quorum 3, a fixed wait of a tenth of the fastest island's round: the bench's ps-wait); ps-auto (quorum 3,
PacedWait(reach, margin)) for every reach x margin; ps-auto-own, the same with `statistics=own` (each island keeps
its own buffers instead of the server's mean: only a model with buffers differs); diloco-own, DiLoCo with
`statistics=own`. `--arms` picks some; `--model
bn-mlp` puts a BatchNorm1d after each of the MLP's hidden layers (running statistics through the server); `--skew`
makes the islands' inputs differ in distribution (skewed()). Writes
OUT/rows.json and prints one line per run.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import islands
from islands.outer import DiLoCo, InProcessServer, ParameterServer, VirtualClock
from islands.sync.outer.ps_wait import PacedWait
from islands.tasks.builtin import digits_task

ISLANDS, STEPS, H, DDP_STEPS, BATCH, LR = 3, 400, 20, 200, 16, 3e-3
STALENESS = 8  # the bench's: a 4x slower island's push is not refused


def schedule(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warm = max(steps // 10, 1)

    def factor(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        done = (s - warm) / max(steps - warm, 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def make_task(model: str, seed: int):
    """The digits task; bn-mlp swaps its MLP for one with a BatchNorm1d after each hidden layer."""
    task = digits_task(batch_size=BATCH, seed=seed)
    if model == "bn-mlp":
        torch.manual_seed(seed)
        nn = torch.nn  # the task's MLP (64-128-128-10) with a BatchNorm1d after each hidden layer
        task.model = nn.Sequential(
            *(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU()),
            *(nn.Linear(128, 128), nn.BatchNorm1d(128), nn.ReLU()),
            nn.Linear(128, 10),
        )
    return task


def val_loss(model: torch.nn.Module, val) -> float:
    was = model.training
    model.eval()  # BatchNorm evaluates with its running statistics
    with torch.no_grad():
        loss = sum(float(F.cross_entropy(model(x), y)) for x, y in val) / len(val)
    model.train(was)
    return loss


def skewed(x: torch.Tensor, island: int, skew: float) -> torch.Tensor:
    """Island i's inputs scaled by 1 + skew i and shifted by skew i: the islands' data differ in distribution
    (island 0's, and the validation set's, not at all)."""
    return x * (1 + skew * island) + skew * island if skew else x


def ddp_target(seed: int, model: str = "mlp", skew: float = 0.0) -> float:
    """DDP's loss after DDP_STEPS: one model on the three islands' batches (their mean gradient) every step."""
    task = make_task(model, seed)
    loaders = [task.train_data(i, ISLANDS) for i in range(ISLANDS)]
    opt = torch.optim.AdamW(task.model.parameters(), lr=LR)
    lr = schedule(opt, DDP_STEPS)
    for _ in range(DDP_STEPS):
        batches = [ld.next() for ld in loaders]
        losses = [F.cross_entropy(task.model(skewed(x, i, skew)), y) for i, (x, y) in enumerate(batches)]
        torch.stack(losses).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        lr.step()
    return val_loss(task.model, task.val_data)


def round_times(times: list[float], jitter: float, seed: int) -> list[list[float]]:
    """Each island's virtual round times, drawn once per seed (every arm of a seed sees the same draws)."""
    rng = random.Random(seed)
    rounds = STEPS // H + 4  # the pushes, the DONE, and room
    return [[t * (1 + rng.uniform(-jitter, jitter)) for _ in range(rounds)] for t in times]


class JitteredClock(VirtualClock):
    """VirtualClock whose island i's k-th round takes rounds[i][k] (not one fixed time): its k-th message arrives
    at the sum of its first k rounds plus what it waited for held answers."""

    def __init__(self, rounds: list[list[float]]):
        super().__init__([r[0] for r in rounds])
        self.ends = [[sum(r[: k + 1]) for k in range(len(r))] for r in rounds]

    def at(self, island: int) -> float:
        return self.waited[island] + self.ends[island][self.taken[island]]

    def now(self, island: int) -> float:
        """When `island`'s last answer reached it: the end of its last taken round plus its waits so far."""
        k = self.taken[island]
        return self.waited[island] + (self.ends[island][k - 1] if k else 0.0)


def run_arm(
    arm: str,
    rounds: list[list[float]],
    seed: int,
    reach: float = 0.0,
    margin: float = 0.0,
    model: str = "mlp",
    skew: float = 0.0,
) -> dict:
    model_name = model
    curve: list[tuple[float, int, float]] = []  # island 0: (virtual time, step, val loss of the answered model)
    server, clock = InProcessServer(), JitteredClock(rounds)
    slowest_ends = [max(r[k] for r in rounds) for k in range(len(rounds[0]))]

    def strategy():
        if arm.startswith("diloco"):
            return DiLoCo(inner_steps=H, statistics="own" if arm == "diloco-own" else "mean")
        quorum, wait = (1, None) if arm == "ps" else (ISLANDS, None)
        if arm == "ps-wait":
            wait = 0.1 * min(r[0] for r in rounds)
        elif arm.startswith("ps-auto"):
            wait = PacedWait(reach=reach, margin=margin)
        statistics = "own" if arm == "ps-auto-own" else "mean"
        return ParameterServer(
            inner_steps=H,
            max_staleness=STALENESS,
            quorum=quorum,
            wait=wait,
            arrivals=clock,
            host=server,
            statistics=statistics,
        )

    def main(world):
        task = make_task(model_name, seed)
        model, loader = task.model, task.train_data(world.rank, ISLANDS)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        lr = schedule(opt, STEPS)
        s_ = strategy()
        s_.wrap(model, opt, world)
        for s in range(STEPS):
            x, y = loader.next()
            x = skewed(x, world.rank, skew)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            lr.step()
            s_.after_step(model, opt, s)
            if world.rank == 0 and (s + 1) % H == 0:
                k = (s + 1) // H
                when = sum(slowest_ends[:k]) if arm.startswith("diloco") else clock.now(0)
                curve.append((when, s + 1, val_loss(model, task.val_data)))
        s_.finish(model)

    torch.set_num_threads(1)
    islands.simulate.run(main, islands=ISLANDS)
    goodput = server.loop.state.goodput() if server.loop is not None else 1.0
    return {"curve": curve, "goodput": goodput}


def first(curve: list[tuple[float, int, float]], target: float) -> tuple[float, int] | None:
    return next(((t, s) for t, s, loss in curve if loss <= target), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--mixes", default="1/2/4,1/1.5/3,1/1/1", help="island round times, fastest first")
    p.add_argument("--jitter", type=float, default=0.1)
    p.add_argument("--reach", default="0.1,0.2,0.35,0.5,0.75,1.0")
    p.add_argument("--margin", default="0,0.1,0.25")
    p.add_argument("--seeds", default="0,1")
    p.add_argument(
        "--arms", default="diloco,ps,ps-wait,ps-auto", help="of diloco,diloco-own,ps,ps-wait,ps-auto,ps-auto-own"
    )
    p.add_argument("--model", default="mlp", choices=("mlp", "bn-mlp"))
    p.add_argument("--skew", type=float, default=0.0, help="island i's inputs x (1 + skew i) + skew i (skewed())")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    reaches = [float(x) for x in a.reach.split(",")]
    margins = [float(x) for x in a.margin.split(",")]
    rows = []
    for seed in (int(x) for x in a.seeds.split(",")):
        target = ddp_target(seed, a.model, a.skew)
        for mix in a.mixes.split(","):
            times = [float(x) for x in mix.split("/")]
            rounds = round_times(times, a.jitter, seed)
            chosen = a.arms.split(",")
            arms = [(x, 0.0, 0.0) for x in ("diloco", "diloco-own", "ps", "ps-wait") if x in chosen]
            arms += [(x, r, m) for x in ("ps-auto", "ps-auto-own") if x in chosen for r in reaches for m in margins]
            for arm, reach, margin in arms:
                t0 = time.perf_counter()
                got = run_arm(arm, rounds, seed, reach, margin, a.model, a.skew)
                hit = first(got["curve"], target)
                row = dict(
                    seed=seed, model=a.model, skew=a.skew, mix=mix, jitter=a.jitter, arm=arm, reach=reach,
                    margin=margin,
                    target=target,
                    time_to_target=hit[0] if hit else None, steps_to_target=hit[1] if hit else None,
                    final_loss=got["curve"][-1][2], end=got["curve"][-1][0], goodput=got["goodput"],
                    curve=got["curve"], wall_s=time.perf_counter() - t0,
                )  # fmt: skip
                rows.append(row)
                print(
                    f"seed {seed} mix {mix} {arm:8s} reach {reach:<5g} margin {margin:<5g} "
                    f"target {target:.4f}: "
                    + (f"{hit[0]:7.2f} vs (step {hit[1]})" if hit else "not reached")
                    + f"  final {row['final_loss']:.4f} at {row['end']:.1f} vs  goodput {row['goodput']:.3f}"
                    f"  ({row['wall_s']:.1f} s)",
                    flush=True,
                )
                (a.out / "rows.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
