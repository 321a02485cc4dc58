"""A Hugging Face `transformers.Trainer` as one island: an outer strategy across islands from a TrainerCallback.

    from islands.integrations.transformers import IslandsCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[IslandsCallback(islands.outer.DiLoCo(inner_steps=50))])
    trainer.train()          # DDP inside the island, as the Trainer does it; DiLoCo across islands
    trainer.save_model()     # the global model

Launch each island as its own job (docs/frameworks.md): `islands run --islands 2 --workers 4 --separate-jobs
train.py` on one machine, or a torchrun per island with ISLANDS_CROSS_* set. Every optimizer step the Trainer takes
is an inner step (gradient accumulation, clipping, mixed precision and the LR schedule stay the Trainer's).

What the callback changes in the Trainer's run, and why:
- in a job of several islands, `args.output_dir` gets a subfolder `island<i>`: islands sharing a machine would
  otherwise write the same checkpoint folders;
- unless `args.data_seed` is set, each island seeds torch with `seed + island` after the Trainer seeded it, so
  the islands draw different data orders (the same order on every island would make them one island's copies);
  every island still starts from island 0's weights (the outer strategy agrees the start);
- each checkpoint folder gets `islands-outer-<local rank>.pt` (the outer state: global model, outer optimizer,
  rounds), read back when `trainer.train(resume_from_checkpoint=...)` resumes; every island must resume;
- at the end of training the model holds the global model, so `trainer.save_model` writes it;
- a restarted island's job (islands.runtime.cross), resumed from its own last checkpoint or started afresh, enters
  at the members' round boundary with their global model, outer state and step (newer than its checkpoint's, whose
  outer state is then not loaded): `state.global_step` and the LR schedule move on to that step, so the Trainer
  runs the steps left to `max_steps` and names its checkpoints as the other islands do.
"""

from __future__ import annotations

import os
import warnings

import torch
from accelerate.optimizer import AcceleratedOptimizer
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from islands.integrations.outer_run import OuterRun
from islands.sync.base import Strategy

CHECKPOINT_PREFIX = "checkpoint"  # transformers' PREFIX_CHECKPOINT_DIR: the Trainer's folders are checkpoint-<step>


def torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer whose step is one update: accelerate's wrapper steps it only when gradients synced."""
    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


def skip_ahead(state: TrainerState, scheduler, step: int) -> None:
    """Move the Trainer's step and its LR schedule to `step` (the data order is not skipped: a restarted island
    draws batches afresh, which an island's own data shard allows)."""
    state.global_step = step
    if scheduler is not None:
        with warnings.catch_warnings():  # torch warns of a schedule stepped before its optimizer: meant here
            warnings.simplefilter("ignore", UserWarning)
            scheduler.last_epoch = step - 1
            scheduler.step()


class IslandsCallback(TrainerCallback):
    """Runs `strategy` (an outer strategy: islands.outer.DiLoCo(...), streaming, with compressors and robust
    aggregators) across islands while the Trainer trains inside its island (module docstring)."""

    def __init__(self, strategy: Strategy, run: OuterRun | None = None):
        self.run = run or OuterRun(strategy)

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        assert args.output_dir is not None  # TrainingArguments fills in its default ("trainer_output")
        world = self.run.join()  # the Trainer's arguments made its process group: join the islands over it
        if world.islands > 1:
            args.output_dir = os.path.join(args.output_dir, f"island{world.island}")
            if args.data_seed is None:
                torch.manual_seed(torch.initial_seed() + world.island)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        resume = None
        assert args.output_dir is not None  # on_init_end saw it set
        if state.global_step > 0:  # the Trainer loaded a checkpoint: it wrote the outer state beside its own
            resume = os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}-{state.global_step}")
        optimizer = torch_optimizer(kwargs["optimizer"])
        step = self.run.begin(kwargs["model"], optimizer, step=state.global_step, resume=resume)
        if step > state.global_step:  # a restarted island entered at the members' step: go on from there
            skip_ahead(state, kwargs.get("lr_scheduler"), step)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        assert args.output_dir is not None  # on_init_end saw it set
        self.run.save(os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}-{state.global_step}"))

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self.run.end(kwargs["model"])

    @property
    def cross_bytes(self) -> int:
        """Bytes this worker sent across islands so far."""
        return self.run.cross_bytes
