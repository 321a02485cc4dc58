"""A Hugging Face Trainer with bf16 mixed precision (CPU autocast: `bf16=True, use_cpu=True`) and gradient
accumulation (ACCUM micro-batches per optimizer step), as one island of `islands run --separate-jobs`, DiLoCo every
INNER_STEPS optimizer steps through IslandsCallback (test_frameworks.test_mixed_precision_and_accumulation_hf).

It prints one RESULT line: the micro-batch losses, how many forwards ran, the dtype autocast computed in, the dtypes
of the parameters and of DiLoCo's global model, the bytes of DiLoCo's exchanges, and a digest of the model after each
round (the step ends where the round count grew) and after training."""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from script_results import digest, precision_result
from sums import Sums
from transformers import Trainer, TrainerCallback, TrainingArguments

import islands
from islands.integrations.transformers import IslandsCallback

STEPS, INNER_STEPS, ACCUM = (int(os.environ[k]) for k in ("STEPS", "INNER_STEPS", "ACCUM"))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.losses: list[float] = []
        self.computed_in: set[str] = set()

    def forward(self, x, labels=None):
        out = self.body(x)
        self.computed_in.add(str(out.dtype))  # bf16 under the Trainer's autocast
        loss = F.mse_loss(out.float(), labels)
        self.losses.append(loss.item())
        return {"loss": loss, "logits": out}


class Rounds(TrainerCallback):
    """The model's digest at every step end where DiLoCo's round count grew (the model is the global one there)."""

    def __init__(self):
        self.seen, self.digests = 0, []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if strategy.rounds > self.seen:
            self.seen = strategy.rounds
            self.digests.append([state.global_step, digest(model)])


torch.manual_seed(0)
model = Net()
strategy = islands.outer.DiLoCo(inner_steps=INNER_STEPS)
callback, rounds = IslandsCallback(strategy), Rounds()
args = TrainingArguments(
    output_dir="out",
    max_steps=STEPS,
    per_device_train_batch_size=16,
    gradient_accumulation_steps=ACCUM,
    learning_rate=0.01,
    lr_scheduler_type="constant",
    bf16=True,
    use_cpu=True,
    save_strategy="no",
    report_to=[],
    disable_tqdm=True,
    logging_strategy="no",
    dataloader_num_workers=0,
)
trainer = Trainer(model=model, args=args, train_dataset=Sums(1000), callbacks=[callback, rounds])
trainer.train()
world = callback.run.join()
precision_result(world, strategy, model, trainer.state.global_step, rounds.digests)
