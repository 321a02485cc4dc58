"""A plain torchrun-style script (DDP over its island's default group, DiLoCo across islands) whose island 1 dies
at step DIE_AT: test_frameworks.test_an_island_that_dies_leaves_the_other_training runs it."""

import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import islands

STEPS, DIE_AT = 60, int(os.environ["DIE_AT"])

world = islands.init_world()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
ddp = DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
strategy = islands.outer.DiLoCo(inner_steps=10)
g = torch.Generator().manual_seed(world.rank)
steps = 0
with strategy.attach(model, opt, world):
    for step in range(STEPS):
        if world.island == 1 and step == DIE_AT:
            os._exit(7)  # the island's job dies (its launcher stops the island's other worker)
        x = torch.randn(16, 8, generator=g)
        F.mse_loss(ddp(x), x.sum(-1, keepdim=True)).backward()
        opt.step()
        opt.zero_grad()
        steps += 1
gone = sorted({name for e in world.cross.events for name in e.get("gone", [])}) if world.cross else []
line = {
    "island": world.island,
    "local_rank": world.local_rank,
    "islands": world.islands,
    "steps": steps,
    "rounds": strategy.rounds,
    "gone": gone,
}
# one write for the whole line: under PYTHONUNBUFFERED print writes the text and its newline in two, and the
# other island's rank 0 shares this stdout
sys.stdout.write("RESULT " + json.dumps(line) + "\n")
sys.stdout.flush()
islands.close_world(world)
