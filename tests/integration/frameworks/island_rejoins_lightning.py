"""island_rejoins.py as a PyTorch Lightning script: the same islands, death and restart, with IslandsCallback running
DiLoCo from Lightning's hooks. Every island checkpoints every 30 steps (ModelCheckpoint, `last.ckpt`); with RESUME=1
(the restarted island 1) `fit` resumes from its own last checkpoint, as a restarted job would, then enters the
members' run at their round boundary: their global model, outer state and step replace the checkpoint's, and
`trainer.global_step` moves on to the members' step, so Lightning runs only the steps left to max_steps."""

import os
import signal
import time
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from script_results import rejoin_result
from torch.utils.data import DataLoader, TensorDataset

import islands
from islands.integrations.lightning import IslandsCallback

STEPS, DIE_AT = int(os.environ.get("STEPS", "200")), int(os.environ.get("DIE_AT", "-1"))
PACE_S = float(os.environ.get("PACE_S", "0"))
INDEX = int(os.environ["ISLANDS_CROSS_INDEX"])


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return F.mse_loss(self.body(x), x.sum(-1, keepdim=True))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Probe(L.Callback):
    """Placed before IslandsCallback (`loaded`: the step Lightning restored) and after it (`start`: where this
    incarnation goes on from); the second one counts the steps run and kills island 1's first incarnation."""

    def __init__(self, after: bool):
        self.after, self.step_at_start, self.steps = after, None, 0

    def on_train_start(self, trainer, pl_module):
        self.step_at_start = trainer.global_step
        if self.after:
            print(f"STARTED {islands_cb.run.join().membership.name} at {self.step_at_start}", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.after:
            return
        self.steps += 1
        if trainer.global_step == DIE_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        membership = islands_cb.run.join().membership
        if PACE_S and not any(e["type"] == "join" for e in membership.events):
            time.sleep(PACE_S)


torch.manual_seed(0)
model = Net()
strategy = islands.outer.DiLoCo(inner_steps=10)
islands_cb, loaded, probe = IslandsCallback(strategy), Probe(after=False), Probe(after=True)
folder = Path("ckpt") / f"island{INDEX}"
trainer = L.Trainer(
    accelerator="cpu",
    devices=1,
    max_steps=STEPS,
    callbacks=[loaded, islands_cb, probe, ModelCheckpoint(dirpath=folder, every_n_train_steps=30, save_last=True)],
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
x = torch.randn(4096, 8, generator=torch.Generator().manual_seed(1000 + INDEX))
resume = str(folder / "last.ckpt") if os.environ.get("RESUME") else None
trainer.fit(model, DataLoader(TensorDataset(x), batch_size=16, shuffle=True), ckpt_path=resume)
world = islands_cb.run.join()
rejoin_result(
    world,
    strategy,
    model,
    loaded=loaded.step_at_start,
    start=probe.step_at_start,
    steps=probe.steps,
    final_step=trainer.global_step,
)  # the global model after training
islands_cb.run.close()
