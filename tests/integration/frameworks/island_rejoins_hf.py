"""island_rejoins.py as a Hugging Face Trainer script: the same islands, death and restart, with IslandsCallback
running DiLoCo from the Trainer's hooks. Every island saves a checkpoint every 30 steps; with RESUME=1 (the
restarted island 1) `trainer.train(resume_from_checkpoint=True)` resumes from its own last one, as a restarted job
would, then enters the members' run at their round boundary: their global model, outer state and step replace the
checkpoint's, and the Trainer goes on from the members' step (`state.global_step` moved by the callback), so it
runs only the steps left to max_steps."""

import os
import signal
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from script_results import rejoin_result
from sums import Sums
from transformers import Trainer, TrainerCallback, TrainingArguments

import islands
from islands.integrations.transformers import IslandsCallback

STEPS, DIE_AT = int(os.environ.get("STEPS", "200")), int(os.environ.get("DIE_AT", "-1"))
PACE_S = float(os.environ.get("PACE_S", "0"))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x, labels=None):
        out = self.body(x)
        return {"loss": F.mse_loss(out, labels), "logits": out}


class Loaded(TrainerCallback):
    """Placed before IslandsCallback: the step the Trainer resumed (0 on a fresh start)."""

    step = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.step = state.global_step


class Probe(TrainerCallback):
    """Notes where this incarnation started and how many steps it ran; island 1's first incarnation is killed."""

    def __init__(self):
        self.start, self.steps = None, 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = state.global_step  # after IslandsCallback's on_train_begin (callbacks run in order)
        print(f"STARTED {islands_cb.run.join().membership.name} at {self.start}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1
        if state.global_step == DIE_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        membership = islands_cb.run.join().membership
        if PACE_S and not any(e["type"] == "join" for e in membership.events):
            time.sleep(PACE_S)


torch.manual_seed(0)
model = Net()
strategy = islands.outer.DiLoCo(inner_steps=10)
islands_cb, loaded, probe = IslandsCallback(strategy), Loaded(), Probe()
args = TrainingArguments(
    output_dir="out",
    max_steps=STEPS,
    per_device_train_batch_size=16,
    learning_rate=0.01,
    lr_scheduler_type="constant",
    save_strategy="steps",
    save_steps=30,
    save_total_limit=1,
    report_to=[],
    use_cpu=True,
    disable_tqdm=True,
    logging_strategy="no",
    dataloader_num_workers=0,
)
ds = Sums(1000 + int(os.environ["ISLANDS_CROSS_INDEX"]), rows=4096)
trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[loaded, islands_cb, probe])
trainer.train(resume_from_checkpoint=True if os.environ.get("RESUME") else None)
world = islands_cb.run.join()
rejoin_result(
    world,
    strategy,
    model,
    loaded=loaded.step,
    start=probe.start,
    final_step=trainer.state.global_step,
    steps=probe.steps,
)  # the global model after training
islands_cb.run.close()
