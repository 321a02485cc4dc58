"""An ordinary LightningModule and Trainer, trained as islands by adding one callback (docs/frameworks.md).

    islands run --workers 4 --islands 2 --separate-jobs examples/lightning_module.py   # 2 islands x 2 workers
    torchrun --nproc-per-node 2 examples/lightning_module.py                            # one island: DDP alone

A GPT-2 from a small config (random initialisation, nothing downloaded) on the bytes of Python's `json` package,
inside a LightningModule; Lightning runs DDP over the island's workers, DiLoCo runs across islands every
INNER_STEPS optimizer steps. The lines marked `# islands` are the whole change to the script.
"""

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

import islands  # islands
from islands.integrations.lightning import IslandsCallback  # islands

CONTEXT = 32
STEPS, INNER_STEPS = int(os.environ.get("STEPS", "40")), int(os.environ.get("INNER_STEPS", "10"))
CHECKPOINT = os.environ.get("CHECKPOINT", "")  # a folder: save there at the end, and resume from it if it exists


class ByteWindows(Dataset):
    def __init__(self, data: torch.Tensor):
        self.data = data

    def __len__(self):
        return (len(self.data) - 1) // CONTEXT

    def __getitem__(self, i):
        return self.data[i * CONTEXT : (i + 1) * CONTEXT].long()


def corpus() -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"]) / "json"
    text = b"".join(p.read_bytes() for p in sorted(root.glob("*.py")))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


class ByteLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main():
    workers = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    module = ByteLM()
    callback = IslandsCallback(islands.outer.DiLoCo(inner_steps=INNER_STEPS))  # islands
    trainer = L.Trainer(
        accelerator="cpu",
        devices=workers,
        strategy="ddp" if workers > 1 else "auto",
        max_steps=STEPS,
        callbacks=[callback],  # islands
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    island = os.environ.get("ISLANDS_CROSS_INDEX", "0")  # each island its own file on a shared machine
    path = Path(CHECKPOINT) / f"island{island}.ckpt" if CHECKPOINT else None
    resume = str(path) if path is not None and path.is_file() else None
    trainer.fit(module, DataLoader(ByteWindows(corpus()), batch_size=8, shuffle=True), ckpt_path=resume)
    if path is not None:
        trainer.save_checkpoint(path)  # the module holds the global model; the callback's state the outer state
    world = callback.run.join()
    params = b"".join(p.detach().numpy().tobytes() for p in module.parameters())
    line = {
        "island": world.island,
        "islands": world.islands,
        "local_rank": world.local_rank,
        "losses": module.losses,
        "cross_bytes": callback.cross_bytes,
        "rounds": callback.run.strategy.rounds,
        "digest": hashlib.sha256(params).hexdigest()[:16],  # the global model, after the final synchronisation
    }
    # one write for the whole line: under PYTHONUNBUFFERED print writes the text and its newline in two, and the
    # other island's rank 0 shares this stdout
    sys.stdout.write("RESULT " + json.dumps(line) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
