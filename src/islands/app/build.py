"""From a job config to the library's objects: the one place that reads JobConfig and builds.

    trainer = build_trainer(cfg, world, run_dir)      task, optimizer, strategy, step, callbacks -> Trainer
    record = run_job(cfg, world, run_dir)             the same, resumed if asked, trained to train.steps

Spec values (compressor, aggregator, attack, outer strategy, optimizer, wrap policy, checkpoint policy),
parsed from strings at the config's edge, become objects here through their packages' registries
(islands.spec.Registry); nothing below this layer sees the job config.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from islands.aggregate.registry import AGGREGATORS
from islands.checkpoint.policy.driver import CheckpointDriver
from islands.checkpoint.policy.fingerprint import fingerprint_of
from islands.checkpoint.policy.resume import resume
from islands.checkpoint.policy.settings import CheckpointSettings, parse_policy
from islands.checkpoint.store.model_dir import ModelWriter, SafetensorsWriter
from islands.compress.optim import OPTIMIZERS, build_optimizer
from islands.compress.registry import COMPRESSORS
from islands.config import JobConfig
from islands.data.source import batch_source
from islands.faults.attacks import ATTACKS
from islands.faults.roles import LabelFlip
from islands.faults.slowdown import parse_slowdown, slow_step
from islands.loop.callbacks import Checkpointing, Evaluate, Progress, RunRecord, SaveModel
from islands.loop.schedule import WarmupCosine
from islands.loop.task import Task
from islands.loop.trainer import Trainer
from islands.memory.recompute import enable_activation_checkpointing
from islands.memory.sizer import MB, batches_like, plan_micro_batch, synthetic_batches
from islands.memory.step import ForwardBackward
from islands.observe import JsonLines, Logging, build_loggers
from islands.observe.backends import stream_name
from islands.parallel.pipeline.strategy import PipelineStages
from islands.runtime.compiled import Compile
from islands.runtime.payload_auth import authenticate_payloads
from islands.runtime.world import World
from islands.sync.base import Strategy, WritesReport
from islands.sync.ddp import DDP
from islands.sync.outer import WarmStart, make_outer
from islands.sync.sharded import FSDP
from islands.sync.single import Single
from islands.sync.stack import Stack
from islands.sync.wrap_policy import WRAP_POLICIES
from islands.sync.zero1 import ZeRO1
from islands.tasks import build_user_task, digits_task, hf_causal_lm, lm_task
from islands.tasks.hf_lm import HFTask, PretrainedWriter, is_pretrained

BETAS = (0.9, 0.95)  # AdamW's betas for the built-in tasks (nanoGPT's choice for small transformers)


def fingerprint(cfg: JobConfig) -> str:
    """What a checkpoint must match to load: the model-defining fields."""
    return fingerprint_of(cfg.fingerprint_fields())


def checkpoint_settings(cfg: JobConfig) -> CheckpointSettings:
    c = cfg.checkpoint
    return CheckpointSettings(
        dir=c.dir or None,
        every=c.every,
        policy=parse_policy(c.policy),
        memory_every=c.memory_every,
        memory_peer=c.memory_peer,
        remote_dir=c.remote_dir or None,
        remote_every=c.remote_every,
        keep=c.keep,
        asynchronous=c.asynchronous,
        share_replicas=c.share_replicas,
        timeout=cfg.world.timeout,
    )


# ---- the task ---------------------------------------------------------------------------------------
def build_task(cfg: JobConfig, run_dir: Path | None = None) -> Task:
    """The built-in lm, digits or hf-causal-lm task, or the user's make_task(cfg) (a TaskError says what is wrong).
    hf-causal-lm saves its tokenizer and model config in `run_dir` (islands.tasks.hf_lm)."""
    t, batch = cfg.task, cfg.batch_per_worker
    if cfg.inner_strategy == "pipeline":  # every stage reads the island's batch: all its workers' share at once
        batch *= cfg.workers_per_island
    if t.name == "lm":
        return lm_task(
            t.data, t.d_model, t.n_layers, t.n_heads, t.context, batch, cfg.train.eval_batches, cfg.train.seed
        )
    if t.name == "digits":
        return digits_task(t.hidden, batch, cfg.train.seed)
    if t.name == "hf-causal-lm":
        return hf_causal_lm(
            t.model,
            t.model_overrides,
            t.tokenizer,
            t.vocab_size,
            t.data,
            t.context,
            batch,
            cfg.train.eval_batches,
            cfg.train.seed,
            t.d_model,
            t.n_layers,
            t.n_heads,
            run_dir,
            cfg.checkpoint.resume,
            t.text_column,
        )
    torch.manual_seed(cfg.train.seed)  # a user model built in make_task starts the same on every rank
    task = build_user_task(t.name, cfg)
    if task.batch_size is None:
        task.batch_size = batch
    return task


# ---- the strategy -----------------------------------------------------------------------------------
def build_inner(cfg: JobConfig, world: World, task: Task) -> Strategy:
    inner = cfg.inner
    kind = cfg.inner_strategy
    if kind == "single":
        return Single()
    if kind == "pipeline":
        assert task.loss_fn is not None  # the last stage computes the loss (PipelineRunner calls loss_fn)
        budget = inner.activation_budget_mb * 1e6 if inner.activation_budget_mb > 0 else math.inf
        return PipelineStages(
            inner.stages or cfg.workers_per_island,
            inner.microbatches,
            inner.cuts,
            inner.schedule,
            batch=cfg.train.global_batch // cfg.world.islands,
            loss_fn=task.loss_fn,
            budget_bytes=budget,
            grad_clip=cfg.train.grad_clip,
            sequence=task.tokens_per_sample,
        )
    if kind == "fsdp":
        assert inner.wrap is not None  # validate: "inner.wrap needs a value"
        return FSDP(
            wrap=WRAP_POLICIES.build(inner.wrap),
            reshard_after_forward=inner.reshard,
            grad_clip=cfg.train.grad_clip > 0,
            prefetch=inner.prefetch,
            shard_group=inner.shard_group,
            memory_budget_bytes=int(inner.shard_budget_mb * 2**20),
        )
    if kind == "zero1":  # DDP's exchange, optimizer state partitioned (SOTA-028)
        return ZeRO1(bucket_mb=inner.bucket_mb)
    # the job's seed is every seeded compressor's default (rank-identical: every rank agrees on it)
    compressor = COMPRESSORS.build(inner.compressor, seed=cfg.train.seed) if inner.compressor else None
    aggregator = AGGREGATORS.build(inner.aggregator) if inner.aggregator else None
    attack = ATTACKS.build(inner.attack) if inner.attack else None
    if attack is not None and isinstance(attack.role, LabelFlip) and attack.role.classes is None:
        attack.role.classes = task.classes
    return DDP(
        compressor=compressor,
        aggregator=aggregator,
        attack=attack,
        bucket_mb=inner.bucket_mb,
        overlap=inner.overlap,
        seed=cfg.train.seed,
    )


def build_outer(cfg: JobConfig, run_dir: Path | None) -> Strategy | None:
    if not cfg.outer.strategy:
        return None
    outer = make_outer(cfg.outer.strategy, warmup=cfg.train.warmup)
    target = report_writer(outer)
    if target is not None:
        target.report_dir = str(run_dir) if run_dir is not None else None
    return outer


def report_writer(outer: Strategy | None) -> WritesReport | None:
    """The outer strategy (inside a warm start too) that writes a report of its own, if it does."""
    target = outer.outer if isinstance(outer, WarmStart) else outer
    return target if isinstance(target, WritesReport) else None


def build_strategy(cfg: JobConfig, world: World, task: Task, run_dir: Path | None = None) -> Stack:
    return Stack(build_inner(cfg, world, task), build_outer(cfg, run_dir))


# ---- the step ---------------------------------------------------------------------------------------
def step_precision(cfg: JobConfig, task: Task) -> str:
    """memory.precision, or the task's own when it is "task" (fp32 under fsdp and pipeline, which own their step's
    arithmetic and take no precision: validation refuses an explicit one there)."""
    if cfg.memory.precision != "task":
        return cfg.memory.precision
    if cfg.inner_strategy in ("fsdp", "pipeline"):
        return "fp32"
    return getattr(task, "precision", "fp32")


def build_step_fn(cfg: JobConfig, task: Task, optimizer: torch.optim.Optimizer | None, world: World) -> ForwardBackward:
    """Activation checkpointing switched on the plain model, precision, micro-batch size. Call before the strategy
    wraps the model: the sizer runs it alone (every rank measures the same shapes, so picks the same size)."""
    m, model = cfg.memory, task.model
    precision = step_precision(cfg, task)
    if m.activation_checkpointing:
        enable_activation_checkpointing(model)  # islands' blocks, or a transformers model's own (non-reentrant)
    if not m.budget_mb:
        return ForwardBackward(m.micro_batch, precision)
    if cfg.task.name in ("lm", "digits"):
        make = synthetic_batches(cfg.task.name, cfg.task.context, world.device, cfg.train.seed)
    else:
        with torch.random.fork_rng():  # a sample batch for shapes; the training RNG must not move
            make = batches_like(batch_source(task.train_data, 0, 1, task.batch_size, cfg.train.seed).next())
    plan = plan_micro_batch(
        model, task.loss_fn, make, task.batch_size or cfg.batch_per_worker, int(m.budget_mb * MB), optimizer, precision
    )
    step = ForwardBackward(plan.micro_batch, precision)
    step.plan = plan
    return step


def build_optimizer_for(cfg: JobConfig, model: torch.nn.Module, world: World) -> torch.optim.Optimizer:
    # 1-bit optimizers average through the island's group themselves (SOTA-215)
    comm = world.comm("local") if world.distributed else None
    assert cfg.train.optimizer is not None  # validate: "train.optimizer needs a value"
    return build_optimizer(
        OPTIMIZERS.build(cfg.train.optimizer),
        model.parameters(),
        lr=cfg.train.lr,
        betas=BETAS,
        weight_decay=cfg.train.weight_decay,
        steps=cfg.train.steps,
        comm=comm,
        model=model,
    )  # muon splits the model's parameters itself (islands.optim.muon_split)


# ---- the trainer ------------------------------------------------------------------------------------
def build_callbacks(cfg: JobConfig, world: World, task: Task, run_dir: Path | None, plot: bool = True) -> list:
    """`plot`: rank 0 draws loss.png (islands' launchers draw it themselves once the job ends)."""
    callbacks = [
        Progress(bar=cfg.output.progress, tokens_per_sample=task.tokens_per_sample),
        Evaluate(every=cfg.train.eval_every),
        RunRecord(
            run_dir,
            config=cfg.to_dict(),
            probe=cfg.world.probe,
            task=task.name,
            data_source=task.data_source,
            tokens_per_sample=task.tokens_per_sample,
            testbed=cfg.world.testbed,
            threads=cfg.world.threads,
            plot=plot,
        ),
    ]
    settings = checkpoint_settings(cfg)
    if settings.enabled:
        callbacks.append(Checkpointing(CheckpointDriver(settings, world, run_dir, fingerprint(cfg))))
    if run_dir is not None:  # every rank's live stream (the dashboard reads it) and the loggers output.log names
        callbacks.append(build_logging(cfg, world, task, Path(run_dir)))
    if run_dir is not None and cfg.output.save_model:  # RUN_DIR/model: the global model, kept whatever else is
        callbacks.append(SaveModel(run_dir, model_writer(task)))
    return callbacks


def model_writer(task: Task) -> ModelWriter:
    """How a task's final model is saved: a transformers model with its tokenizer (from_pretrained loads it),
    any other as model.safetensors, a transformers model inside a user's own wrapper module included."""
    if isinstance(task, HFTask) and task.tokenizer is not None and is_pretrained(task.model):
        return PretrainedWriter(task.tokenizer)
    return SafetensorsWriter()


def build_logging(cfg: JobConfig, world: World, task: Task, run_dir: Path) -> Logging:
    """This process's stream: rank<r>, or the elastic member's name; the job (the run directory's name) groups
    the streams in MLflow and W&B (islands.observe.backends: the layout)."""
    stream = stream_name(world.membership.name if world.membership is not None else f"rank{world.rank}")
    job = run_dir.resolve().name
    loggers = [JsonLines(run_dir / "live" / f"{stream}.jsonl"), *build_loggers(cfg.output.log, run_dir, stream, job)]
    return Logging(loggers, tokens_per_sample=task.tokens_per_sample, params={"stream": stream, "job": job})


def build_trainer(
    cfg: JobConfig, world: World, run_dir: Path | None = None, callbacks: Sequence = (), plot: bool = True
) -> Trainer:
    torch.set_num_threads(cfg.world.threads)
    if cfg.inner_strategy == "pipeline" and world.data_shard is None:  # all stages of an island read one stream
        world.data_shard = (world.island, world.islands) if world.distributed else (0, 1)
    task = build_task(cfg, run_dir)
    model = task.model.to(world.device)
    optimizer = build_optimizer_for(cfg, model, world)
    step_fn = build_step_fn(cfg, task, optimizer, world)
    if cfg.world.slowdown:  # a slower host rehearsed on this one: this process sleeps its share after each step
        step_fn = slow_step(step_fn, parse_slowdown(cfg.world.slowdown), world.rank, world.island)
    if cfg.outer.authenticate and world.distributed:  # before the outer strategy takes its Comm; collective
        authenticate_payloads(world)
    strategy = build_strategy(cfg, world, task, run_dir)
    pipeline = cfg.inner_strategy == "pipeline"  # the pipeline clips by the norm over all stages itself
    return Trainer(
        model,
        optimizer,
        task.loss_fn,
        task.train_data,
        task.val_data,
        strategy=strategy,
        world=world,
        schedule=WarmupCosine(cfg.train.warmup, cfg.train.steps, cfg.train.min_lr_ratio),
        callbacks=[*build_callbacks(cfg, world, task, run_dir, plot), *callbacks],
        metrics=task.metrics,
        batch_size=task.batch_size,
        grad_clip=0.0 if pipeline else cfg.train.grad_clip,
        step_fn=step_fn,
        seed=cfg.train.seed,
        log_every=cfg.train.log_every,
        compile=Compile(cfg.train.compile_backend, cfg.train.compile_mode) if cfg.train.compile else None,
    )


def resume_trainer(trainer: Trainer, cfg: JobConfig) -> dict:
    info = resume(
        trainer, cfg.checkpoint.resume, remote_dir=cfg.checkpoint.remote_dir or None, fingerprint=fingerprint(cfg)
    )
    if trainer.checkpoints is not None:  # intervals count from here; its record keeps where we came from
        trainer.checkpoints.resumed(trainer.step, info)
    else:
        trainer.resumed_from = info
    return info


def run_job(cfg: JobConfig, world: World, run_dir: Path | None = None, plot: bool = True) -> dict:
    """Build, resume if asked, train to train.steps; returns the run record (rank 0 also writes it, and with `plot`
    its loss.png)."""
    trainer = build_trainer(cfg, world, run_dir, plot=plot)
    if cfg.checkpoint.resume:
        resume_trainer(trainer, cfg)
    return trainer.fit(cfg.train.steps)
