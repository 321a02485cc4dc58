"""islands' Trainer on a `transformers` GPT-2 built from a config (random initialisation, nothing downloaded).

    islands run --workers 2 --islands 2 examples/trainer_gpt2.py
    python examples/trainer_gpt2.py                                   # one process

Batches are dicts of model keyword arguments ({"input_ids", "labels"}); the model's own output carries
the loss (`loss_fn=None`) and its logits, which evaluation reads. Data: the bytes of Python's own
`json` package as tokens (vocabulary 256), sharded per worker by a Dataset and a DistributedSampler.
Two islands run streaming DiLoCo (2 fragments, 4-bit deltas) across them.
"""

import os
import sys
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

import islands

CONTEXT, STEPS = 64, int(os.environ.get("STEPS", "60"))


class ByteWindows(Dataset):
    def __init__(self, data: torch.Tensor):
        self.data = data

    def __len__(self):
        return (len(self.data) - 1) // CONTEXT

    def __getitem__(self, i):
        w = self.data[i * CONTEXT : (i + 1) * CONTEXT]
        return {"input_ids": w, "labels": w}  # GPT-2 shifts the labels itself


def corpus() -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"]) / "json"
    text = b"".join(p.read_bytes() for p in sorted(root.glob("*.py")))
    return torch.tensor(list(text), dtype=torch.long)


def main():
    torch.manual_seed(0)
    world = islands.init_world()
    data = corpus()
    split = int(len(data) * 0.9)
    train, val = ByteWindows(data[:split]), ByteWindows(data[split:])
    config = GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outer = islands.outer.StreamingDiLoCo(inner_steps=20, fragments=2, tau=1) if world.islands > 1 else None
    trainer = islands.Trainer(
        model=model,
        optimizer=opt,
        loss_fn=None,
        train_data=train,
        val_data=torch.utils.data.Subset(val, range(32)),
        batch_size=8,
        strategy=islands.Stack(outer=outer),
        world=world,
        schedule=islands.WarmupCosine(warmup=10, total=STEPS),
        callbacks=[islands.Evaluate(every=20)],
        grad_clip=1.0,
    )
    trainer.fit(STEPS)
    first, last = trainer.series["val"][0]["val_loss"], trainer.series["val"][-1]["val_loss"]
    if world.rank == 0:
        print(
            f"trainer_gpt2: {world.size} worker(s), strategy {trainer.strategy.name}: validation loss "
            f"{first:.3f} -> {last:.3f}"
        )
    islands.close_world(world)
    return last < first


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
