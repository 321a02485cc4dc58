"""Your own model, data, optimizer and loop, with islands underneath.

    islands run --workers 4 --islands 2 examples/own_loop.py
    torchrun --nproc-per-node 4 examples/own_loop.py

MyModel is a small CNN with BatchNorm on scikit-learn's 8x8 digits (the data ships with the package):
a model islands did not write, whose running statistics must follow the parameters across islands.
Two islands of two workers: DDP with PowerSGD inside each island, DiLoCo with a coordinate-median
outer aggregate across them.
"""

import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import islands

STEPS = int(os.environ.get("STEPS", "120"))
RUN_DIR = os.environ.get("RUN_DIR", "runs/own-loop")
CKPT_EVERY = int(os.environ.get("CKPT_EVERY", "100"))


class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.head = nn.Linear(32 * 2 * 2, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.head(x.flatten(1))


def digits():
    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target, dtype=torch.long)
    order = torch.from_numpy(np.random.default_rng(0).permutation(len(y)))
    return x[order], y[order]


X, Y = digits()
TRAIN, VAL = slice(0, 1500), slice(1500, None)


def my_batches(rank, size, skip=0, batch=16):
    """This rank's shard, reshuffled every epoch; `skip` batches already trained on (after a restore)."""
    x, y = X[TRAIN][rank::size], Y[TRAIN][rank::size]
    step, epoch = 0, 0
    while True:
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
        for i in range(0, len(y) - batch + 1, batch):
            if step >= skip:
                idx = order[i : i + batch]
                yield x[idx], y[idx]
            step += 1
        epoch += 1


def my_loss(logits, y):
    return F.cross_entropy(logits, y)


@torch.no_grad()
def accuracy(model):
    model.eval()
    right = (model(X[VAL]).argmax(-1) == Y[VAL]).float().mean().item()
    model.train()
    return right


def main():
    torch.manual_seed(0)  # the same initial model on every rank
    # --- the program from the README, as a user writes it ---------------------------------------
    world = islands.init_world(
        islands=2
    )  # env:// from `islands run` or torchrun; reuses an existing default process group
    model = MyModel().to(world.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    strategy = islands.Stack(
        inner=islands.inner.DDP(compressor=islands.compress.PowerSGD(rank=4)),
        outer=islands.outer.DiLoCo(inner_steps=50, aggregator=islands.robust.CoordinateMedian()),
    )
    model = strategy.wrap(model, opt, world)
    ckpt = islands.Checkpointer(RUN_DIR, world, every=CKPT_EVERY)  # async, multi-level, checksummed; RNG included
    start = ckpt.restore(model=model, optimizer=opt, strategy=strategy) or 0
    for step, (x, y) in enumerate(my_batches(world.rank, world.size, skip=start), start=start):
        if step >= STEPS:
            break
        loss = my_loss(model(x), y)
        loss.backward()
        strategy.after_backward(model, step)
        opt.step()
        opt.zero_grad()
        strategy.after_step(model, opt, step)
        ckpt.maybe_save(step + 1, model=model, optimizer=opt, strategy=strategy)
    strategy.finish(model)  # the final synchronisation; no total step count needed up front
    global_model = strategy.eval_model(model)  # what to evaluate and export: parameters AND buffers
    # ---------------------------------------------------------------------------------------------
    ckpt.close()
    acc = accuracy(global_model)
    tracked = int(global_model.bn1.num_batches_tracked)
    if world.rank == 0:
        print(
            f"own_loop: {world.size} worker(s), {world.islands} island(s), strategy {strategy.name}: "
            f"global model validation accuracy {acc:.3f}, bn1.num_batches_tracked {tracked}, "
            f"sent {world.ledger.total_sent / 1e6:.2f} MB by rank 0"
        )
    islands.close_world(world)
    return acc


if __name__ == "__main__":
    sys.exit(0 if main() > 0.5 else 1)
