"""n data-parallel workers under attack, simulated in ONE process with the real aggregator and attack code.

A grid of attacks x aggregators x f at n = 8 is hundreds of training runs; as real processes on a
small machine that is days. Synchronous data parallelism keeps every worker's parameters identical,
so one model stands for all of them: each step computes every worker's gradient on that worker's own
data shard (the shards `build_task` gives rank r of n, as in a real job), lets the attack plan corrupt
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

from islands.aggregate import Mean, parse_aggregator
from islands.config import TrainConfig
from islands.faults.attacks import parse_attack
from islands.task import build_task, evaluate
from islands.trainer import lr_at


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
    """`cfg.workers` workers of one synchronous data-parallel job, in this process."""

    def __init__(self, cfg: TrainConfig, aggregate: str = "mean", attack: str = "none"):
        if cfg.workers < 2:
            raise ValueError(f"simulating an attack needs at least 2 workers, got workers={cfg.workers}")
        if attack.split(":")[0].strip().lower() == "straggler":
            raise ValueError("a straggler changes time, not values: simulating it in one process only sleeps; "
                             "rehearse it on a real job (islands train --attack straggler:delay=...)")
        self.cfg = cfg
        n = cfg.workers
        tasks = [build_task(cfg, shard=r, shards=n) for r in range(n)]  # identical model, own shard each
        self.task, self.loaders = tasks[0], [t.loader for t in tasks]
        self.model = self.task.model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # The Trainer's optimizer, so a simulated cell and a real run of the same config agree.
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        self.aggregator = parse_aggregator(aggregate)
        self.plan = parse_attack(attack, world_size=n, seed=cfg.seed)
        self.mean = Mean()
        self.step = 0
        self.aggregate_times: list[float] = []
        self.mean_times: list[float] = []

    def worker_gradient(self, rank: int) -> tuple[torch.Tensor, float]:
        x, y = self.loaders[rank].next()
        y = self.plan.flip_labels(y, self.task.classes, rank)
        loss = self.task.loss_fn(self.model(x), y)
        grads = torch.autograd.grad(loss, self.params)
        return torch.cat([g.reshape(-1) for g in grads]), loss.item()

    def train_step(self) -> float:
        """One synchronous step; returns the honest workers' mean training loss."""
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, cfg)
        honest, losses = [], []
        for r in range(cfg.workers):
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
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
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

    def run(self) -> SimulatedRun:
        start = time.perf_counter()
        diverged, error = False, ""
        while self.step < self.cfg.steps:
            try:
                loss = self.train_step()
            except (ValueError, FloatingPointError) as e:  # TooFewInputsError is a ValueError
                error = f"{type(e).__name__}: {e}"
                break
            if not math.isfinite(loss) or not self.finite():
                diverged = True
                break
        metrics = evaluate(self.model, self.task, torch.device("cpu"))
        val_loss = metrics["val_loss"]
        if diverged or not math.isfinite(val_loss):
            diverged, val_loss = True, float("inf")
        return SimulatedRun(
            aggregate=repr(self.aggregator), attack=self.plan.spec, workers=self.cfg.workers, byzantine=self.plan.f,
            steps=self.step, final_val_loss=val_loss, final_val_accuracy=metrics["val_accuracy"], diverged=diverged,
            aggregate_seconds=sum(self.aggregate_times), mean_seconds=sum(self.mean_times),
            aggregate_step_seconds=_median(self.aggregate_times), mean_step_seconds=_median(self.mean_times),
            dropped_inputs=self.aggregator.dropped_total, wall_seconds=time.perf_counter() - start, error=error,
        )


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def simulate(cfg: TrainConfig, aggregate: str = "mean", attack: str = "none") -> SimulatedRun:
    """Train cfg.steps steps of cfg.workers simulated workers; see the module doc for what is simulated."""
    torch.set_num_threads(cfg.threads)
    return SimulatedWorkers(cfg, aggregate, attack).run()
