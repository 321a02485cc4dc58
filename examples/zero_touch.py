"""A loop you do not want to edit: the strategy hooks run from the optimizer's own step hooks.

    islands run --workers 2 --islands 2 examples/zero_touch.py
    torchrun --nproc-per-node 2 examples/zero_touch.py

The loop below is plain PyTorch; only the `with` line is islands. Two islands of one worker run
DiLoCo (50 inner AdamW steps, then one outer Nesterov step on the averaged delta); leaving the block
runs the final synchronisation, and `eval_model` is the global model.
"""

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import islands

STEPS = int(os.environ.get("STEPS", "150"))


def main():
    torch.manual_seed(0)
    world = islands.init_world()  # islands from `islands run --islands`, else 1
    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    strategy = islands.outer.DiLoCo(inner_steps=50)
    g = torch.Generator().manual_seed(world.rank)  # each island its own data order
    with strategy.attach(model, opt, world):
        for _ in range(STEPS):  # --- the unchanged loop ---
            idx = torch.randint(0, 1500, (32,), generator=g)
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            opt.zero_grad()
    global_model = strategy.eval_model(model)
    with torch.no_grad():
        acc = (global_model(x[1500:]).argmax(-1) == y[1500:]).float().mean().item()
    if world.rank == 0:
        print(
            f"zero_touch: {world.size} worker(s), {world.islands} island(s), {strategy.rounds} DiLoCo rounds: "
            f"global model validation accuracy {acc:.3f}"
        )
    islands.close_world(world)
    return acc


if __name__ == "__main__":
    sys.exit(0 if main() > 0.5 else 1)
