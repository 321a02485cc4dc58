"""An ordinary accelerate training loop, trained as islands by three added lines (docs/frameworks.md).

    islands run --workers 4 --islands 2 --separate-jobs examples/accelerate_loop.py   # 2 islands x 2 workers
    accelerate launch --num_processes 2 --cpu examples/accelerate_loop.py             # one island: DDP alone

`Accelerator.prepare` wraps the model in DDP over the island's own default process group; `islands.init_world()`
(after it) joins the islands when ISLANDS_CROSS_* say this job is one of several, and the strategy runs from the
optimizer's own step hooks. The same three lines work in a plain torchrun script that makes its own default group
(examples/zero_touch.py). The lines marked `# islands` are the whole change to the script.
"""

import hashlib
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import islands  # islands

STEPS, INNER_STEPS = int(os.environ.get("STEPS", "60")), int(os.environ.get("INNER_STEPS", "10"))


def main():
    accelerator = Accelerator(cpu=True)
    world = islands.init_world()  # islands: after the Accelerator made the island's group
    torch.manual_seed(world.island)  # each island its own data order (every island starts from island 0's weights)
    d = load_digits()
    data = TensorDataset(torch.tensor(d.data[:1500] / 16.0, dtype=torch.float32), torch.tensor(d.target[:1500]))
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(data, batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    strategy = islands.outer.DiLoCo(inner_steps=INNER_STEPS)  # islands
    losses, step = [], 0
    with strategy.attach(model, optimizer.optimizer, world):  # islands: the torch optimizer accelerate wraps
        while step < STEPS:
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
                step += 1
                if step == STEPS:
                    break
    global_model = strategy.eval_model(model)
    with torch.no_grad():
        x = torch.tensor(d.data[1500:] / 16.0, dtype=torch.float32)
        acc = (global_model(x).argmax(-1) == torch.tensor(d.target[1500:])).float().mean().item()
    params = b"".join(p.detach().numpy().tobytes() for p in global_model.parameters())
    line = {
        "island": world.island,
        "islands": world.islands,
        "local_rank": world.local_rank,
        "losses": losses,
        "accuracy": acc,
        "cross_bytes": world.ledger.total_sent,
        "rounds": strategy.rounds,
        "digest": hashlib.sha256(params).hexdigest()[:16],
    }
    # one write for the whole line: under PYTHONUNBUFFERED print writes the text and its newline in two, and the
    # other island's rank 0 shares this stdout
    sys.stdout.write("RESULT " + json.dumps(line) + "\n")
    sys.stdout.flush()
    islands.close_world(world)


if __name__ == "__main__":
    main()
