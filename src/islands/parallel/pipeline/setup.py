"""From a job config to a pipeline strategy, and the checks that run before any worker starts."""

from __future__ import annotations

import math

from islands.parallel.pipeline.chooser import divisors
from islands.parallel.pipeline.cuts import parse_cuts
from islands.parallel.pipeline.schedule import SCHEDULES
from islands.parallel.pipeline.strategy import PipelineStages, parse_microbatches


def pipeline_pieces(cfg) -> int:
    """How many pieces the config's model has: embedding + blocks + head, or the MLP's three layers."""
    return cfg.n_layers + 2 if cfg.task == "lm" else 3


def pipeline_stages(cfg) -> int:
    return cfg.stages or cfg.workers_per_island


def check_pipeline_config(cfg) -> None:
    """Spec fields always (a typo shows before inner=pipeline is chosen); the rest under inner=pipeline."""
    parse_cuts(cfg.cuts)
    parse_microbatches(cfg.microbatches)
    if cfg.pipeline_schedule not in SCHEDULES:
        raise ValueError(f"pipeline_schedule={cfg.pipeline_schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if cfg.stages < 0 or cfg.activation_budget_mb < 0:
        raise ValueError("stages and activation_budget_mb must be >= 0 (0: one stage per worker / no budget)")
    if cfg.inner_strategy != "pipeline":
        return
    k = pipeline_stages(cfg)
    if k != cfg.workers_per_island:
        raise ValueError(f"stages={k} needs one worker per stage: set workers={k * cfg.islands} "
                         f"(with islands={cfg.islands}) or stages={cfg.workers_per_island}")
    pieces = pipeline_pieces(cfg)
    if k > pieces:
        raise ValueError(f"stages={k} but the {cfg.task} model has only {pieces} pieces to cut between "
                         f"({'n_layers + 2' if cfg.task == 'lm' else 'three layers'}); use stages <= {pieces}")
    m = parse_microbatches(cfg.microbatches)
    batch = cfg.global_batch // cfg.islands
    if m != "auto" and batch % m:
        raise ValueError(f"microbatches={m} does not divide the pipeline's batch of {batch}; "
                         f"choose one of {divisors(batch)} or 'auto'")
    from islands.compress.optim import parse_optimizer

    clash = [f"{key}={getattr(cfg, key)!r}" for key, ok in
             (("compress", ("", "none")), ("aggregate", ("", "mean")), ("attack", ("",)), ("outer", ("",)),
              ("elastic", (False,)), ("resume", ("",)), ("ckpt_every", (0,)), ("ckpt_memory_every", (0,)),
              ("ckpt_remote_every", (0,)), ("ckpt_policy", ("",)),
              # islands.memory's per-worker micro-batching and precision act on a whole local model
              ("micro_batch", (0,)), ("memory_budget_mb", (0.0,)), ("activation_checkpointing", (False,)),
              ("precision", ("fp32",)))
             if getattr(cfg, key, ok[0]) not in ok]
    if parse_optimizer(cfg.optimizer).communicates:
        clash.append(f"optimizer={cfg.optimizer!r}")
    if cfg.islands != 1:
        clash.append(f"islands={cfg.islands}")
    if clash:
        raise ValueError(f"inner=pipeline splits one model over the island's ranks and does not yet combine with "
                         f"{', '.join(clash)}; drop them, or use inner=ddp or fsdp for those")


def pipeline_from_config(cfg) -> PipelineStages:
    import torch.nn.functional as F

    from islands.models import sequence_loss

    budget = cfg.activation_budget_mb * 1e6 if cfg.activation_budget_mb > 0 else math.inf
    return PipelineStages(pipeline_stages(cfg), cfg.microbatches, cfg.cuts, cfg.pipeline_schedule,
                          batch=cfg.global_batch // cfg.islands,
                          loss_fn=sequence_loss if cfg.task == "lm" else F.cross_entropy,
                          budget_bytes=budget, grad_clip=cfg.grad_clip)
