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

The Trainer composes small parts with their own state: the step's body (islands.loop.step_body: lr,
forward/backward, clip, optimizer, skip-ahead) with its readout (islands.loop.step_readout: the loss kept on
the device until a log entry or a callback reads it, the step times), and the callbacks
(islands.loop.callback_list). It keeps the loop's position (step, total_steps, steps_this_fit, the data
cursor), its clocks and the series: what callbacks read.

The Trainer is also the state a checkpoint saves (islands.checkpoint.policy.driver's TrainingState): step, the
model to evaluate (parameters and buffers), the optimizer (full under FSDP), the strategy, the data
position, the RNG, the loss series, and each callback's state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from islands.checkpoint.policy.rng import rng_state, set_rng_state
from islands.checkpoint.policy.sharded_state import load_optimizer_state_dict, optimizer_state_dict
from islands.data.batches import size as batch_size_of, to_device
from islands.data.source import batch_source, val_batches
from islands.loop.callback_list import CallbackList
from islands.loop.callbacks import Evaluate
from islands.loop.evaluate import evaluate
from islands.loop.step_body import StepBody, compile_record
from islands.memory.step import ForwardBackward
from islands.runtime.compiled import Compile, as_compile
from islands.runtime.world import World
from islands.sync.base import Describes, Reports, Strategy, capability
from islands.sync.stack import Stack


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
        compile: bool | Compile | None = None,
    ):
        """`model` and `optimizer`: the user's own (the optimizer built on the model's parameters). `loss_fn(prediction,
        targets)` -> scalar, or None when the model's output carries its loss. `train_data`: a Dataset (with
        `batch_size`), a DataLoader, an iterable of batches, or a function (shard, shards) -> batches; this rank's
        shard is `world.shard`. `val_data`: batches every rank evaluates. `strategy`: how ranks cooperate (default
        `Stack()`: DDP over the island). `world`: from islands.init_world (default: one process). `schedule`: a
        function step -> factor of each group's initial lr, or a torch LRScheduler. `callbacks`: islands.loop.callbacks
        and the user's own. `metrics`: name -> fn(prediction, targets), averaged over validation samples.
        `grad_clip`: max global gradient norm (0: none). `step_fn`: micro-batches and precision (islands.memory).
        `seed`: the data order of a Dataset. `log_every`: steps per entry of the training-loss series. `compile`: True
        (islands.Compile(): inductor) or islands.Compile(backend=..., mode=...) runs forward and backward through
        torch.compile, applied to the model the strategy wrapped; the run record's `compile` part has its time."""
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
        self.optimizer = optimizer
        shard, shards = self.world.shard
        self.data = batch_source(train_data, shard, shards, batch_size, seed)
        self.val_data = val_batches(val_data, batch_size)
        step_fn = step_fn or ForwardBackward()
        self.callbacks = CallbackList(callbacks)
        self.resumed_from: dict | None = None  # what resume() loaded, when no checkpoint driver keeps it (app.build)
        if self.val_data is not None and not any(isinstance(cb, Evaluate) for cb in self.callbacks):
            self.callbacks = self.callbacks.added(Evaluate())  # at least the final model
        self.model = self.strategy.wrap(model.to(self.world.device), optimizer, self.world)
        self.body = StepBody(
            self.model,
            optimizer,
            self.strategy,
            loss_fn=loss_fn,
            step_fn=step_fn,
            grad_clip=float(grad_clip),
            schedule=schedule,
            metrics=dict(metrics or {}),
            log_every=int(log_every),
            compile=as_compile(compile),
        )
        self.step = self.world.start_step  # 0, or where the members were when an elastic joiner entered
        self.total_steps = 0
        self.steps_this_fit = 0
        self.series: dict[str, list] = {"train": [], "val": []}
        self.elapsed = 0.0  # training wall time so far, excluding evaluation and the probe
        self.sync_seconds = 0.0  # time inside after_step and finish: what an outer strategy's exchange blocks
        self.compute_seconds = self.comm_seconds = 0.0
        self.samples_per_step = 0  # samples in one global batch (all workers), from the first batch
        self.started = time.time()
        self.record: dict | None = None
        self.log: Callable[[str], None] = lambda text: None  # the Progress callback gives it a console

    @property
    def step_fn(self) -> ForwardBackward:
        """Micro-batches and precision of the step (islands.memory)."""
        return self.body.step_fn

    # ---- one step -------------------------------------------------------------------------------
    def train_step(self) -> float:
        """One step; returns its loss as a float (which waits for the device: the fit loop reads it lazily)."""
        self._step()
        return self.loss

    @property
    def loss(self) -> float:
        """The last step's loss on the host (read from the device once, on first use)."""
        return self.body.readout.loss

    def _step(self) -> None:
        step = self.step
        self.body.set_lr(step)
        batch = to_device(self.strategy.on_batch(self.data.next(), step), self.world.device)
        if not self.samples_per_step:
            self.samples_per_step = batch_size_of(batch) * self.world.size
        # all micro-batches, one gradient; the first step explains a batch the model cannot take
        loss = self.body.forward_backward(batch, explain=self.steps_this_fit == 0)
        self.body.update(step)  # after_backward, clip, optimizer step, zero_grad, a torch LRScheduler's step
        t = time.perf_counter()
        self.strategy.after_step(self.model, self.optimizer, step)
        self.sync_seconds += time.perf_counter() - t  # the loop blocked on the outer strategy
        self.step = self.body.next_step(self.step + 1, self.total_steps)  # a slower island may skip ahead
        self.body.readout.took(loss)  # stays on the device until someone reads it

    # ---- the loop -------------------------------------------------------------------------------
    def add_callback(self, callback) -> None:
        """Add a callback after construction; it runs in its `order` among the others."""
        self.callbacks = self.callbacks.added(callback)

    def fit(self, steps: int) -> dict:
        """Train until `steps` steps are done (counting from 0, so a resumed trainer continues); returns the run
        record when a RunRecord callback made one, else the summary of the series."""
        if steps < 0:
            raise ValueError(f"steps must be >= 0; got {steps}")
        self.total_steps, self.steps_this_fit = int(steps), 0
        ledger = self.world.ledger
        overridden = type(self).train_step is not Trainer.train_step
        self.callbacks = CallbackList(self.callbacks)  # a list the user assigned is sorted and run like the built one
        self.callbacks.fit_start(self)
        while self.step < self.total_steps:
            t0, busy0 = time.perf_counter(), ledger.busy_seconds
            if overridden:  # a subclass's own train_step (it returns the loss as a float) runs as it always did
                self.body.readout.took_float(self.train_step())
            else:
                self._step()
            dt = time.perf_counter() - t0
            self.steps_this_fit += 1
            self.elapsed += dt
            self.body.readout.timed(dt)
            busy = ledger.busy_seconds - busy0
            self.comm_seconds += busy
            self.compute_seconds += dt - busy
            self._log_train()
            self.callbacks.step_end(self)
        t = time.perf_counter()
        self.strategy.finish(self.model)  # the final synchronisation: the global model holds every island's work
        dt = time.perf_counter() - t
        self.sync_seconds += dt
        self.elapsed += dt
        self.callbacks.fit_end(self)
        return self.record if self.record is not None else {"series": self.series, "steps": self.step}

    def _log_train(self) -> None:
        mean = self.body.readout.entry(self.step, self.total_steps)  # None between log entries
        if mean is not None:
            lr = self.optimizer.param_groups[0]["lr"]
            self.series["train"].append(
                {
                    "step": self.step,
                    "loss": mean,
                    "lr": lr,
                    "elapsed": self.elapsed,
                    "mb_sent": self.world.ledger.total_sent / 1e6,
                }
            )

    def evaluate(self, max_batches: int | None = None) -> dict:
        """Validation of the model the strategy reports (the global model under an outer strategy)."""
        if self.val_data is None:
            raise ValueError("no val_data was given to the Trainer")
        return evaluate(
            self.strategy.eval_model(self.model),
            self.val_data,
            self.body.loss_fn,
            self.world.device,
            self.body.metrics,
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
        return self.body.readout.median_seconds()

    def record_parts(self) -> dict:
        """What the strategy and the step contribute to the run record (memory plan, pipeline stages, checkpoints)."""
        parts = {}
        if self.step_fn.micro_batch or self.step_fn.precision != "fp32" or self.step_fn.plan is not None:
            parts["memory"] = self.step_fn.record()
        if self.body.compile is not None:  # this fit's first step against its steady ones
            parts["compile"] = compile_record(self.body, self.world)
        described = capability(self.strategy, Describes)  # type: ignore[type-abstract]  # mypy#4717 (Protocol as type[C])
        if described is not None:  # a pipeline: every stage's measured activations
            mine = described.describe()
            parts["pipeline"] = {
                "stages": self.world.all_gather_object(mine) if self.world.distributed else [mine],
                "definition": "held_activation_bytes_peak: storages autograd saved plus the stage's "
                "input and output, for micro-batches in flight at once",
            }
        reporting = capability(self.strategy, Reports)  # type: ignore[type-abstract]  # mypy#4717, as above
        if reporting is not None:  # a parameter server: what its servers did, measured where they ran
            parts.update(reporting.run_report())
        parts.update(self.callbacks.records())
        if self.resumed_from is not None:
            parts.setdefault("checkpoint", {})["resumed_from"] = self.resumed_from
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
        if hasattr(self.body.schedule, "state_dict"):
            state["schedule"] = self.body.schedule.state_dict()
        kept = self.callbacks.states()
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
        if "schedule" in state and hasattr(self.body.schedule, "load_state_dict"):
            self.body.schedule.load_state_dict(state["schedule"])
        self.callbacks.load_states(state.get("callbacks", {}))
        if self.world.membership is not None and "membership" in state:
            self.world.membership.load_state_dict(state["membership"])

    @property
    def checkpoints(self):
        """The checkpoint driver of a Checkpointing callback, if any (elastic membership settles saves through it)."""
        return self.callbacks.driver()
