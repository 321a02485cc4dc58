"""A Lightning Trainer with `precision="bf16-mixed"` (CPU autocast) and gradient accumulation (ACCUM batches per
optimizer step), as one island of `islands run --separate-jobs`, DiLoCo every INNER_STEPS optimizer steps through
IslandsCallback (test_frameworks.test_mixed_precision_and_accumulation_lightning). Its RESULT line says what
precision_hf.py's says."""

import os

import lightning.pytorch as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from script_results import digest, precision_result
from torch.utils.data import DataLoader, TensorDataset

import islands
from islands.integrations.lightning import IslandsCallback

STEPS, INNER_STEPS, ACCUM = (int(os.environ[k]) for k in ("STEPS", "INNER_STEPS", "ACCUM"))


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.losses: list[float] = []
        self.computed_in: set[str] = set()

    def training_step(self, batch, batch_idx):
        (x,) = batch
        out = self.body(x)
        self.computed_in.add(str(out.dtype))  # bf16 under Lightning's autocast
        loss = F.mse_loss(out.float(), x.sum(-1, keepdim=True))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class Rounds(L.Callback):
    """The model's digest at every batch end where DiLoCo's round count grew (the model is the global one there)."""

    def __init__(self):
        self.seen, self.digests = 0, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if strategy.rounds > self.seen:
            self.seen = strategy.rounds
            self.digests.append([trainer.global_step, digest(pl_module)])


torch.manual_seed(0)
model = Net()
strategy = islands.outer.DiLoCo(inner_steps=INNER_STEPS)
callback, rounds = IslandsCallback(strategy), Rounds()
trainer = L.Trainer(
    accelerator="cpu",
    devices=1,
    precision="bf16-mixed",
    accumulate_grad_batches=ACCUM,
    max_steps=STEPS,
    callbacks=[callback, rounds],
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
x = torch.randn(2048, 8, generator=torch.Generator().manual_seed(1000))
trainer.fit(model, DataLoader(TensorDataset(x), batch_size=16, shuffle=True))
world = callback.run.join()
precision_result(world, strategy, model, trainer.global_step, rounds.digests)
