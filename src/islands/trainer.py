"""The one training loop. Components are built from one config; strategies act through hooks.

Read top to bottom: build world-independent pieces (task, optimizer, schedule), let the strategy wrap
the model, then step: batch -> forward -> backward -> after_backward -> clip -> optimizer.step ->
after_step, with validation, measurement and checkpoints at fixed points.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import numpy as np
import torch

from islands.checkpoint.sharded_state import load_optimizer_state_dict, optimizer_state_dict
from islands.config import TrainConfig
from islands.measure.probe import describe, probe_interconnect
from islands.memory.build import build_forward_backward, memory_settings_on
from islands.measure.progress import TrainProgress, summary_table
from islands.measure.record import BASELINE_PER_WORKER, finish_record, versions
from islands.runtime.world import World
from islands.sync.registry import build_strategy
from islands.task import build_task, evaluate


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio of the peak."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(cfg.steps - cfg.warmup, 1)
    progress = min((step - cfg.warmup) / span, 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


class Trainer:
    def __new__(cls, cfg: TrainConfig, *args, **kwargs):
        if cls is Trainer and cfg.inner == "pipeline":  # a pipeline owns forward and backward (docs/pipeline.md)
            from islands.parallel.pipeline.trainer import PipelineTrainer

            cls = PipelineTrainer
        return super().__new__(cls)

    def __init__(self, cfg: TrainConfig, world: World, run_dir: Path | None = None):
        self.cfg, self.world = cfg, world
        self.run_dir = run_dir
        torch.set_num_threads(cfg.threads)
        shard, shards = world.data_shard or (world.rank, world.size)  # elastic workers keep theirs
        self.task = build_task(cfg, shard=shard, shards=shards)
        model = self.task.model.to(world.device)
        self.optimizer = self._build_optimizer(model)
        # checkpointing, precision, micro-batches; sized on the plain model before wrapping (islands.memory)
        self.forward_backward = build_forward_backward(cfg, model, self.task.loss_fn, self.optimizer, world.device)
        self.strategy = build_strategy(cfg, world)
        self.model = self.strategy.wrap(model, self.optimizer, world)
        self.attack = self._build_attack()
        from islands.checkpoint.driver import build_checkpointing

        self.checkpoints = build_checkpointing(cfg, world, run_dir)  # None unless a checkpoint level is set
        self.step = 0
        self.series: dict[str, list] = {"train": [], "val": []}
        self.elapsed = 0.0  # training wall time so far, excluding probe and evaluation
        self.sync_seconds = 0.0  # time inside after_step: what an outer strategy's exchange blocks

    def _build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        factory = self.cfg.extra.get("optimizer_factory")
        if factory is not None:
            return factory(model, self.cfg, self.world)
        from islands.compress.optim import build_optimizer

        # 1-bit optimizers average through the island's group themselves (SOTA-215)
        comm = self.world.comm("local") if self.world.distributed else None
        return build_optimizer(self.cfg.optimizer, model.parameters(), lr=self.cfg.lr, betas=(0.9, 0.95),
                               weight_decay=self.cfg.weight_decay, steps=self.cfg.steps, comm=comm)

    def _build_attack(self):
        if not self.cfg.attack:
            return None
        from islands.faults.attacks import parse_attack

        return parse_attack(self.cfg.attack, world_size=self.world.size, seed=self.cfg.seed)

    # ---- one step -------------------------------------------------------------------------------
    def train_step(self) -> float:
        cfg, step = self.cfg, self.step
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = self.task.loader.next()
        if self.attack is not None:
            y = self.attack.flip_labels(y, self.task.classes, self.world.rank)
        x, y = x.to(self.world.device), y.to(self.world.device)
        loss = self.forward_backward(self.model, self.task.loss_fn, x, y)  # all micro-batches, one gradient
        self.strategy.after_backward(self.model, step)
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t = time.perf_counter()
        self.strategy.after_step(self.model, self.optimizer, step)
        self.sync_seconds += time.perf_counter() - t  # the loop blocked on the outer strategy
        self.step += 1
        return loss.item()

    # ---- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {
            "step": self.step,
            "model": self.strategy.eval_model(self.model).state_dict(),
            "optimizer": optimizer_state_dict(self.model, self.optimizer, self.world),  # full under fsdp
            "strategy": self.strategy.state_dict(),
            "loader": self.task.loader.state_dict(),
            "rng": rng_state(),
            "elapsed": self.elapsed,
            "series": self.series,
        }
        if self.world.membership is not None:  # elastic: epoch and members (islands.runtime.elastic)
            state["membership"] = self.world.membership.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.strategy.eval_model(self.model).load_state_dict(state["model"])
        load_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])  # any world size
        self.strategy.load_state_dict(state["strategy"])
        self.task.loader.load_state_dict(state["loader"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.elapsed = float(state.get("elapsed", 0.0))
        self.series = state.get("series", self.series)
        if self.world.membership is not None and "membership" in state:
            self.world.membership.load_state_dict(state["membership"])

    # ---- the loop -------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        return evaluate(self.strategy.eval_model(self.model), self.task, self.world.device)

    def run(self, on_step=None) -> dict:
        """Train to cfg.steps; returns the run record (rank 0 also writes it to run_dir)."""
        cfg, world, ledger = self.cfg, self.world, self.world.ledger
        lead = world.rank == 0
        interconnect = probe_interconnect(world) if (cfg.probe and world.distributed) else {"measured": False}
        if cfg.testbed:
            from islands.testbed import Testbed

            interconnect["testbed"] = Testbed.load(cfg.testbed).record()
        progress = TrainProgress(cfg.steps, enabled=lead and cfg.progress, start=self.step)
        tokens_per_step = cfg.global_batch * self.task.tokens_per_sample
        if lead and cfg.progress:
            progress.log(f"[bold]islands[/] {self.strategy.name} · {world.size} workers / {world.islands} island(s) · "
                         f"data: {self.task.data_source} · interconnect: {describe(interconnect)}")
        compute_s = comm_s = 0.0
        losses: list[float] = []
        step_times: list[float] = []  # the median resists other processes' bursts on a shared machine
        if self.step == 0 and cfg.eval_every:  # where the curve starts: an untrained model
            self.series["val"].append({"step": 0, "elapsed": 0.0, "mb_sent": 0.0, **self.evaluate()})
        while self.step < cfg.steps:
            t0, busy0 = time.perf_counter(), ledger.busy_seconds
            loss = self.train_step()
            dt = time.perf_counter() - t0
            self.elapsed += dt
            step_times.append(dt)
            busy = ledger.busy_seconds - busy0
            comm_s += busy
            compute_s += dt - busy
            losses.append(loss)
            mb = ledger.total_sent / 1e6
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                self.series["train"].append({"step": self.step, "loss": sum(losses) / len(losses),
                                             "lr": lr_at(self.step - 1, cfg), "elapsed": self.elapsed, "mb_sent": mb})
                losses = []
            progress.update(self.step, loss, tokens_per_step * self.step / max(self.elapsed, 1e-9), mb)
            if (cfg.eval_every and self.step % cfg.eval_every == 0) or self.step == cfg.steps:
                metrics = self.evaluate()
                self.series["val"].append({"step": self.step, "elapsed": self.elapsed, "mb_sent": mb, **metrics})
                progress.log(f"step {self.step:>5}  val loss {metrics['val_loss']:.4f}  "
                             f"acc {100 * metrics['val_accuracy']:.1f}%  sent {mb:.2f} MB")
            if on_step is not None:
                on_step(self)
            if self.checkpoints is not None:
                self.checkpoints.after_step(self)
        if self.checkpoints is not None:
            self.checkpoints.finish(self)  # final checkpoint, durable before the record is written
        progress.close()
        return self._finish(interconnect, compute_s, comm_s, tokens_per_step, step_times)

    def _finish(self, interconnect: dict, compute_s: float, comm_s: float, tokens_per_step: int,
                step_times: list[float]) -> dict:
        cfg, world = self.cfg, self.world
        ledgers = [world.ledger.snapshot()]
        if world.distributed:
            ledgers = world.all_gather_object(world.ledger.snapshot())  # bookkeeping, not training traffic
        final = self.series["val"][-1] if self.series["val"] else self.evaluate()
        total_sent = sum(l["total_sent"] for l in ledgers)
        steps_run = max(len(self.series["train"]) and self.step, 1)
        summary = {
            "task": cfg.task,
            "strategy": self.strategy.name,
            "workers": world.size,
            "islands": world.islands,
            "steps": self.step,
            "wall_seconds": self.elapsed,
            "seconds_per_step": self.elapsed / steps_run,
            "median_seconds_per_step": float(np.median(step_times)) if step_times else 0.0,
            "tokens_per_second": tokens_per_step * self.step / max(self.elapsed, 1e-9),
            "final_val_loss": final["val_loss"],
            "final_val_accuracy": final.get("val_accuracy"),
            "mb_sent_per_worker": total_sent / world.size / 1e6,
            "bytes_sent_per_worker_per_step": total_sent / world.size / steps_run,
            "compute_seconds": compute_s,
            "comm_seconds": comm_s,
            "comm_fraction": comm_s / max(compute_s + comm_s, 1e-9),
            "sync_blocked_seconds": self.sync_seconds,
            "baseline": BASELINE_PER_WORKER.format(threads=cfg.threads, device=world.device.type),
        }
        record = {
            "versions": versions(),
            "config": {k: v for k, v in cfg.to_dict().items() if k != "extra"},
            "world": {"size": world.size, "islands": world.islands, "workers_per_island": world.workers_per_island,
                      "backend": world.backend, "device": str(world.device), "threads_per_worker": cfg.threads},
            "interconnect": interconnect,
            "interconnect_line": describe(interconnect),
            "baseline": {"definition": summary["baseline"], "unit": "worker"},
            "comm": {"per_rank": ledgers, "definition": "payload bytes handed to collectives (see islands.runtime.comm)"},
            "series": self.series,
            "summary": summary,
        }
        if memory_settings_on(cfg):
            record["memory"] = self.forward_backward.record()
        from islands.checkpoint.driver import checkpoint_record

        if (ckpt := checkpoint_record(self)) is not None:  # levels, saves, stall, interval decisions, resume
            record["checkpoint"] = ckpt
        if world.rank == 0 and self.run_dir is not None:
            finish_record(self.run_dir, record)
            if cfg.progress:
                from rich.console import Console

                Console().print(summary_table(summary, record["interconnect_line"]))
                Console().print(f"run record: {self.run_dir / 'run.json'}  plot: {self.run_dir / 'loss.png'}")
        return record
