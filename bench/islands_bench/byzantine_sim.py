"""n data-parallel workers under attack, simulated in ONE process with the real aggregator and attack code.

A grid of attacks x aggregators x f at n = 8 is hundreds of training runs; as real processes on a
small machine that is days. Synchronous data parallelism keeps every worker's parameters identical,
so one model stands for all of them: each step computes every worker's gradient on that worker's own
data shard (the shard rank r of n would read in a real job), lets the attack plan corrupt
what the Byzantine ranks send (`AttackPlan.corrupt_all`, the same roles a real job uses), aggregates
with the same aggregator object, then clips and steps exactly as the Trainer does.

What differs from a real job: no bytes move, so nothing about the network is measured; Krum-style
distances see one flat vector where DDP would aggregate per bucket (the same thing while the model
fits one 25 MB bucket, as both bench models do); a straggler sleeps serially. Aggregation time is
measured per step on the inputs actually sent, and the mean of the very same inputs is timed next to
it, so the cost ratio to mean comes from one run on one machine state.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from islands import Task, WarmupCosine, evaluate
from islands.aggregate import AGGREGATORS, Aggregator
from islands.app.build import build_task
from islands.config import JobConfig
from islands.data import batch_source
from islands.faults import ATTACKS, flip_targets
from islands.robust import Byzantine, LabelFlip, Mean


@dataclass
class SimulatedRun:
    aggregate: str
    attack: str
    workers: int
    byzantine: int
    steps: int  # steps actually taken (fewer if training diverged)
    final_val_loss: float  # inf if the loss or the parameters stopped being finite
    final_val_accuracy: float
    diverged: bool
    aggregate_seconds: float  # total time in the aggregator, all steps
    mean_seconds: float  # total time the plain mean took on the same inputs
    aggregate_step_seconds: float  # median per step: robust to a busy machine preempting a few steps
    mean_step_seconds: float
    dropped_inputs: int  # inputs turned away for holding NaN/Inf
    wall_seconds: float
    error: str = ""  # an aggregator that refused the round (e.g. too few inputs) ends the run here

    @property
    def cost_vs_mean(self) -> float:
        """Aggregation time relative to the mean of the same inputs (ratio of per-step medians)."""
        return self.aggregate_step_seconds / max(self.mean_step_seconds, 1e-12)

    def to_dict(self) -> dict:
        return {**asdict(self), "cost_vs_mean": self.cost_vs_mean}


class SimulatedWorkers:
    """`workers` workers of one synchronous data-parallel job, in this process.

    `task`: the job's Task (its model stands for every worker's; each worker reads its own shard of
    task.train_data). `aggregator`: the robust aggregator (None: the mean). `attack`: the Byzantine plan.
    `lr`, `weight_decay`, `betas`, `schedule` (step -> factor of lr), `grad_clip`: the Trainer's AdamW step,
    so that a simulated cell and a real run of the same job agree. `seed`: the data order and attack noise."""

    def __init__(
        self,
        task: Task,
        workers: int,
        aggregator: Aggregator | None = None,
        attack: Byzantine | None = None,
        *,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas=(0.9, 0.95),
        schedule=None,
        grad_clip: float = 1.0,
        seed: int = 0,
    ):
        if workers < 2:
            raise ValueError(f"simulating an attack needs at least 2 workers, got workers={workers}")
        if attack is not None and getattr(attack.role, "name", "") == "straggler":
            raise ValueError(
                "a straggler changes time, not values: simulating it in one process only sleeps; "
                "rehearse it on a real job (islands train --attack straggler:delay=...)"
            )
        self.task, self.workers = task, workers
        self.sources = [batch_source(task.train_data, r, workers, task.batch_size, seed) for r in range(workers)]
        self.model = task.model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.lr, self.schedule, self.grad_clip = lr, schedule, grad_clip
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay, betas=betas)
        self.aggregator = aggregator if aggregator is not None else Mean()
        self.plan = attack.plan(workers, seed) if attack is not None else Byzantine.honest(workers)
        self.mean = Mean()
        self.step = 0
        self.aggregate_times: list[float] = []
        self.mean_times: list[float] = []

    def worker_gradient(self, rank: int) -> tuple[torch.Tensor, float]:
        x, y = self.sources[rank].next()
        if isinstance(self.plan.attack, LabelFlip) and self.plan.is_byzantine(rank):
            y = flip_targets(y, self.plan.attack.classes or self.task.classes)
        loss = self.task.loss_fn(self.model(x), y)
        grads = torch.autograd.grad(loss, self.params)
        return torch.cat([g.reshape(-1) for g in grads]), loss.item()

    def train_step(self) -> float:
        """One synchronous step; returns the honest workers' mean training loss."""
        if self.schedule is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr * self.schedule(self.step)
        honest, losses = [], []
        for r in range(self.workers):
            g, loss = self.worker_gradient(r)
            honest.append(g)
            if not self.plan.is_byzantine(r):
                losses.append(loss)
        sent = self.plan.corrupt_all(honest)
        combined = self._timed_aggregate(sent)
        offset = 0
        for p in self.params:
            p.grad = combined[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return sum(losses) / len(losses)

    def _timed_aggregate(self, sent: list[torch.Tensor]) -> torch.Tensor:
        # Mean and aggregator run on the same inputs; who goes first alternates so that neither
        # always finds the inputs warm in cache.
        first_mean = self.step % 2 == 0
        if first_mean:
            t0 = time.perf_counter()
            self.mean.aggregate(sent)
            self.mean_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        combined = self.aggregator.aggregate(sent)
        self.aggregate_times.append(time.perf_counter() - t0)
        if not first_mean:
            t0 = time.perf_counter()
            self.mean.aggregate(sent)
            self.mean_times.append(time.perf_counter() - t0)
        return combined

    def finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.params)

    def run(self, steps: int) -> SimulatedRun:
        start = time.perf_counter()
        diverged, error = False, ""
        while self.step < steps:
            try:
                loss = self.train_step()
            except (ValueError, FloatingPointError) as e:  # TooFewInputsError is a ValueError
                error = f"{type(e).__name__}: {e}"
                break
            if not math.isfinite(loss) or not self.finite():
                diverged = True
                break
        metrics = evaluate(self.model, self.task.val_data, self.task.loss_fn, torch.device("cpu"))
        val_loss = metrics["val_loss"]
        if diverged or not math.isfinite(val_loss):
            diverged, val_loss = True, float("inf")
        return SimulatedRun(
            aggregate=repr(self.aggregator),
            attack=self.plan.spec,
            workers=self.workers,
            byzantine=self.plan.f,
            steps=self.step,
            final_val_loss=val_loss,
            final_val_accuracy=metrics["val_accuracy"],
            diverged=diverged,
            aggregate_seconds=sum(self.aggregate_times),
            mean_seconds=sum(self.mean_times),
            aggregate_step_seconds=_median(self.aggregate_times),
            mean_step_seconds=_median(self.mean_times),
            dropped_inputs=self.aggregator.dropped_total,
            wall_seconds=time.perf_counter() - start,
            error=error,
        )


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def simulate(
    task: Task,
    workers: int,
    steps: int,
    aggregator: Aggregator | None = None,
    attack: Byzantine | None = None,
    **step_options,
) -> SimulatedRun:
    """Train `steps` steps of `workers` simulated workers; see the module doc for what is simulated."""
    return SimulatedWorkers(task, workers, aggregator, attack, **step_options).run(steps)


def simulated_job(cfg: JobConfig, aggregator: str = "mean", attack: str = "") -> SimulatedWorkers:
    """The in-process twin of the job `islands train` would run from `cfg` with these aggregator and attack
    specs: the same task, AdamW settings, warm-up-cosine schedule, clipping and seed."""
    return SimulatedWorkers(
        build_task(cfg),
        cfg.world.workers,
        AGGREGATORS.build(aggregator) if aggregator else None,
        ATTACKS.build(attack) if attack else None,
        lr=cfg.train.lr,
        weight_decay=cfg.train.weight_decay,
        schedule=WarmupCosine(cfg.train.warmup, cfg.train.steps, cfg.train.min_lr_ratio),
        grad_clip=cfg.train.grad_clip,
        seed=cfg.train.seed,
    )
