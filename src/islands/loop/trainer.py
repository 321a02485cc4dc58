"""The one training loop, built from the user's objects; strategies act through hooks, the rest are callbacks.

    trainer = Trainer(model=model, optimizer=opt, loss_fn=F.cross_entropy, train_data=dataset,
                      val_data=val, strategy=Stack(outer=DiLoCo(inner_steps=50)), world=world,
                      schedule=WarmupCosine(30, 1000), callbacks=[Evaluate(every=100)], batch_size=32)
    result = trainer.fit(1000)

Each step, read top to bottom:

    batch -> strategy.on_batch -> forward + backward (micro-batches, precision: islands.memory.step)
          -> strategy.after_backward -> clip -> optimizer.step -> zero_grad -> strategy.after_step
          -> step = strategy.next_step(step + 1)   (step + 1, unless the rounds let this island skip ahead)

and after the last step `strategy.finish` (the final synchronisation), then the callbacks' on_fit_end
(final evaluation, final checkpoint, run record). The loop never knows which strategy runs; a strategy
never owns the loop. A strategy that owns forward and backward (a pipeline) supplies `forward_backward`.

The Trainer is also the state a checkpoint saves (islands.checkpoint.policy.driver's TrainingState): step, the
model to evaluate (parameters and buffers), the optimizer (full under FSDP), the strategy, the data
position, the RNG, the loss series, and each callback's state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from islands.checkpoint.policy.rng import rng_state, set_rng_state
from islands.checkpoint.policy.sharded_state import load_optimizer_state_dict, optimizer_state_dict
from islands.data.batches import size as batch_size_of, to_device
from islands.data.source import batch_source, val_batches
from islands.loop.callbacks import Evaluate
from islands.loop.evaluate import evaluate
from islands.memory.step import ForwardBackward
from islands.runtime.world import World
from islands.sync.base import Describes, OwnsStep, SkipsSteps, Strategy, capability
from islands.sync.stack import Stack


def _order(cb, end: bool = False) -> int:
    return getattr(cb, "end_order", getattr(cb, "order", 50)) if end else getattr(cb, "order", 50)


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable | None = None,
        train_data: Any = None,
        val_data: Any = None,
        *,
        strategy: Strategy | None = None,
        world: World | None = None,
        schedule: Callable[[int], float] | Any = None,
        callbacks: Iterable = (),
        metrics: dict[str, Callable] | None = None,
        batch_size: int | None = None,
        grad_clip: float = 0.0,
        step_fn: ForwardBackward | None = None,
        seed: int = 0,
        log_every: int = 10,
    ):
        """`model` and `optimizer`: the user's own (the optimizer built on the model's parameters). `loss_fn(prediction,
        targets)` -> scalar, or None when the model's output carries its loss. `train_data`: a Dataset (with
        `batch_size`), a DataLoader, an iterable of batches, or a function (shard, shards) -> batches; this rank's
        shard is `world.shard`. `val_data`: batches every rank evaluates. `strategy`: how ranks cooperate (default
        `Stack()`: DDP over the island). `world`: from islands.init_world (default: one process). `schedule`: a
        function step -> factor of each group's initial lr, or a torch LRScheduler. `callbacks`: islands.loop.callbacks
        and the user's own. `metrics`: name -> fn(prediction, targets), averaged over validation samples.
        `grad_clip`: max global gradient norm (0: none). `step_fn`: micro-batches and precision (islands.memory).
        `seed`: the data order of a Dataset. `log_every`: steps per entry of the training-loss series."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(
                f"the model ({type(model).__name__}) has no trainable parameters: nothing to train "
                "(were they all frozen with requires_grad_(False)?)"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer built on the model's parameters; "
                f"got {type(optimizer).__name__}"
            )
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be callable (prediction, targets) -> scalar, or None; got {type(loss_fn).__name__}"
            )
        if grad_clip < 0 or log_every < 1:
            raise ValueError(f"need grad_clip >= 0 and log_every >= 1; got {grad_clip}, {log_every}")
        self.world = world or World.single()
        self.strategy = Stack() if strategy is None else strategy
        if not isinstance(self.strategy, Strategy):
            raise TypeError(
                f"strategy must be an islands strategy (islands.Stack(...), islands.inner.DDP(), "
                f"islands.outer.DiLoCo(...)); got {type(self.strategy).__name__}"
            )
        self.optimizer, self.loss_fn = optimizer, loss_fn
        shard, shards = self.world.shard
        self.data = batch_source(train_data, shard, shards, batch_size, seed)
        self.val_data = val_batches(val_data, batch_size)
        self.metrics = dict(metrics or {})
        self.schedule: Any = schedule  # duck-typed: a function step -> factor, or a torch LRScheduler
        self.grad_clip, self.log_every = float(grad_clip), int(log_every)
        self.step_fn = step_fn or ForwardBackward()
        self.callbacks = sorted(callbacks, key=_order)
        if self.val_data is not None and not any(isinstance(cb, Evaluate) for cb in self.callbacks):
            self.callbacks = sorted([*self.callbacks, Evaluate()], key=_order)  # at least the final model
        self.model = self.strategy.wrap(model.to(self.world.device), optimizer, self.world)
        # a pipeline owns its step. The ignores: mypy#4717, a Protocol class refused as type[C] (isinstance takes it)
        owner = capability(self.strategy, OwnsStep)  # type: ignore[type-abstract]
        self._own_step = owner.forward_backward if owner is not None else None
        self._skips = capability(self.strategy, SkipsSteps)  # type: ignore[type-abstract]
        self._base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.step = self.world.start_step  # 0, or where the members were when an elastic joiner entered
        self.total_steps = 0
        self.steps_this_fit = 0
        self.series: dict[str, list] = {"train": [], "val": []}
        self.elapsed = 0.0  # training wall time so far, excluding evaluation and the probe
        self.sync_seconds = 0.0  # time inside after_step and finish: what an outer strategy's exchange blocks
        self.compute_seconds = self.comm_seconds = 0.0
        self.samples_per_step = 0  # samples in one global batch (all workers), from the first batch
        self.step_times: list[float] = []  # the median resists other processes' bursts on a shared machine
        self.started = time.time()
        self.record: dict | None = None
        self.resumed_from: dict | None = None  # what resume loaded, when no checkpoint driver keeps it (app.build)
        self.log: Callable[[str], None] = lambda text: None  # the Progress callback gives it a console
        # the loss is read on the host only where someone reads it (a log entry, a callback that asks): on a GPU
        # a float() each step would stall the queue of kernels every step
        self._loss: torch.Tensor | None = None  # the last step's loss, float64, where the step left it
        self._loss_value: float | None = None
        self._loss_sum: torch.Tensor | None = None  # since the last log entry
        self._loss_count = 0

    # ---- one step -------------------------------------------------------------------------------
    def _set_lr(self, step: int) -> None:
        if self.schedule is None:
            return
        if hasattr(self.schedule, "step") and hasattr(self.schedule, "get_last_lr"):
            return  # a torch LRScheduler: stepped after the optimizer
        factor = self.schedule(step)
        for group, base in zip(self.optimizer.param_groups, self._base_lrs):
            group["lr"] = base * factor

    def train_step(self) -> float:
        """One step; returns its loss as a float (which waits for the device: the fit loop reads it lazily)."""
        self._step()
        return self.loss

    @property
    def loss(self) -> float:
        """The last step's loss on the host (read from the device once, on first use)."""
        if self._loss_value is None and self._loss is not None:
            self._loss_value = float(self._loss)
        return self._loss_value if self._loss_value is not None else float("nan")

    def _step(self) -> None:
        step = self.step
        self._set_lr(step)
        batch = to_device(self.strategy.on_batch(self.data.next(), step), self.world.device)
        if not self.samples_per_step:
            self.samples_per_step = batch_size_of(batch) * self.world.size
        loss: float | torch.Tensor
        if self._own_step is not None:
            loss = self._own_step(*batch)
        else:  # all micro-batches, one gradient; the first step explains a batch the model cannot take
            loss = self.step_fn(self.model, batch, self.loss_fn, explain=self.steps_this_fit == 0)
        self.strategy.after_backward(self.model, step)
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if hasattr(self.schedule, "get_last_lr"):
            self.schedule.step()
        t = time.perf_counter()
        self.strategy.after_step(self.model, self.optimizer, step)
        self.sync_seconds += time.perf_counter() - t  # the loop blocked on the outer strategy
        self.step += 1
        if self._skips is not None:  # a slower island may skip to its round's end (not the run's)
            self.step = max(self.step, min(int(self._skips.next_step(self.step)), self.total_steps))
        # float64 on the device: the series' means equal those of the host floats, added in the same order
        self._loss = torch.as_tensor(loss).detach().reshape(()).to(torch.float64)
        self._loss_value = None

    # ---- the loop -------------------------------------------------------------------------------
    def add_callback(self, callback) -> None:
        """Add a callback after construction; it runs in its `order` among the others."""
        self.callbacks = sorted([*self.callbacks, callback], key=_order)

    def fit(self, steps: int) -> dict:
        """Train until `steps` steps are done (counting from 0, so a resumed trainer continues); returns the run
        record when a RunRecord callback made one, else the summary of the series."""
        if steps < 0:
            raise ValueError(f"steps must be >= 0; got {steps}")
        self.total_steps, self.steps_this_fit = int(steps), 0
        ledger = self.world.ledger
        overridden = type(self).train_step is not Trainer.train_step
        for cb in self.callbacks:
            if hasattr(cb, "on_fit_start"):
                cb.on_fit_start(self)
        while self.step < self.total_steps:
            t0, busy0 = time.perf_counter(), ledger.busy_seconds
            if overridden:  # a subclass's own train_step (it returns the loss as a float) runs as it always did
                self._loss_value = float(self.train_step())
                self._loss = torch.tensor(self._loss_value, dtype=torch.float64)
            else:
                self._step()
            dt = time.perf_counter() - t0
            self.steps_this_fit += 1
            self.elapsed += dt
            self.step_times.append(dt)
            busy = ledger.busy_seconds - busy0
            self.comm_seconds += busy
            self.compute_seconds += dt - busy
            self._log_train()
            for cb in self.callbacks:  # one that says it does not read the loss gets None (no wait on the device)
                if hasattr(cb, "on_step_end"):
                    cb.on_step_end(self, self.loss if getattr(cb, "reads_loss", True) else None)
        t = time.perf_counter()
        self.strategy.finish(self.model)  # the final synchronisation: the global model holds every island's work
        dt = time.perf_counter() - t
        self.sync_seconds += dt
        self.elapsed += dt
        for cb in sorted(self.callbacks, key=lambda c: _order(c, end=True)):
            if hasattr(cb, "on_fit_end"):
                cb.on_fit_end(self)
        return self.record if self.record is not None else {"series": self.series, "steps": self.step}

    def _log_train(self) -> None:
        loss = self._loss
        assert loss is not None  # the step just taken left it
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._loss_count += 1
        if self.step % self.log_every == 0 or self.step == self.total_steps:
            lr = self.optimizer.param_groups[0]["lr"]
            mean = float(self._loss_sum) / self._loss_count
            self.series["train"].append(
                {
                    "step": self.step,
                    "loss": mean,
                    "lr": lr,
                    "elapsed": self.elapsed,
                    "mb_sent": self.world.ledger.total_sent / 1e6,
                }
            )
            self._loss_sum, self._loss_count = None, 0

    def evaluate(self, max_batches: int | None = None) -> dict:
        """Validation of the model the strategy reports (the global model under an outer strategy)."""
        if self.val_data is None:
            raise ValueError("no val_data was given to the Trainer")
        return evaluate(
            self.strategy.eval_model(self.model),
            self.val_data,
            self.loss_fn,
            self.world.device,
            self.metrics,
            max_batches,
        )

    @property
    def eval_model(self) -> torch.nn.Module:
        """What to evaluate and export: the strategy's model, parameters and buffers."""
        return self.strategy.eval_model(self.model)

    def gradient_bytes(self) -> int:
        """Bytes of one full gradient of the trainable parameters (what plain DDP all-reduces per step)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)

    def median_step_seconds(self) -> float:
        return float(np.median(self.step_times)) if self.step_times else 0.0

    def record_parts(self) -> dict:
        """What the strategy and the step contribute to the run record (memory plan, pipeline stages, checkpoints)."""
        parts = {}
        if self.step_fn.micro_batch or self.step_fn.precision != "fp32" or self.step_fn.plan is not None:
            parts["memory"] = self.step_fn.record()
        described = capability(self.strategy, Describes)  # type: ignore[type-abstract]  # mypy#4717 (see __init__)
        if described is not None:  # a pipeline: every stage's measured activations
            mine = described.describe()
            parts["pipeline"] = {
                "stages": self.world.all_gather_object(mine) if self.world.distributed else [mine],
                "definition": "held_activation_bytes_peak: storages autograd saved plus the stage's "
                "input and output, for micro-batches in flight at once",
            }
        for cb in self.callbacks:
            extra = getattr(cb, "record", None)
            if callable(extra):
                part = extra()
                if part is not None:
                    parts[getattr(cb, "record_key", type(cb).__name__.lower())] = part
        resumed = self.resumed_from
        if resumed is not None:
            parts.setdefault("checkpoint", {})["resumed_from"] = resumed
        return parts

    # ---- state (islands.checkpoint.policy.driver.TrainingState) --------------------------------------------
    @property
    def shard_items(self) -> int:
        sampler = getattr(self.data, "sampler", None)
        return int(getattr(sampler, "n", getattr(self.data, "shard_items", -1)))

    def model_state_dict(self) -> dict:
        return self.strategy.eval_model(self.model).state_dict()

    def state_dict(self) -> dict:
        state = {
            "step": self.step,
            "model": self.model_state_dict(),
            "optimizer": optimizer_state_dict(self.model, self.optimizer, self.world),  # full under fsdp
            "strategy": self.strategy.state_dict(),
            "loader": self.data.state_dict(),
            "rng": rng_state(),
            "elapsed": self.elapsed,
            "series": self.series,
        }
        if hasattr(self.schedule, "state_dict"):
            state["schedule"] = self.schedule.state_dict()
        kept = {
            type(cb).__name__: cb.state_dict()
            for cb in self.callbacks
            if hasattr(cb, "state_dict") and hasattr(cb, "load_state_dict")
        }
        if kept:
            state["callbacks"] = kept
        if self.world.membership is not None:  # elastic: epoch and members (islands.runtime.elastic)
            state["membership"] = self.world.membership.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.strategy.eval_model(self.model).load_state_dict(state["model"])
        load_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])  # any world size
        self.strategy.load_state_dict(state["strategy"])
        self.data.load_state_dict(state["loader"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.elapsed = float(state.get("elapsed", 0.0))
        self.series = state.get("series", self.series)
        if "schedule" in state and hasattr(self.schedule, "load_state_dict"):
            self.schedule.load_state_dict(state["schedule"])
        for cb in self.callbacks:
            saved = state.get("callbacks", {}).get(type(cb).__name__)
            if saved is not None and hasattr(cb, "load_state_dict"):
                cb.load_state_dict(saved)
        if self.world.membership is not None and "membership" in state:
            self.world.membership.load_state_dict(state["membership"])

    @property
    def checkpoints(self):
        """The checkpoint driver of a Checkpointing callback, if any (elastic membership settles saves through it)."""
        for cb in self.callbacks:
            driver = getattr(cb, "driver", None)
            if driver is not None:
                return driver
        return None
