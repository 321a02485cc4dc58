"""From a TrainConfig to the step body: checkpointing switched on the model, precision, micro-batch size."""

from __future__ import annotations

import torch

from islands.memory.sizer import MB, plan_micro_batch, synthetic_batches
from islands.memory.step import ForwardBackward, check_precision


def memory_settings_on(cfg) -> bool:
    return bool(cfg.activation_checkpointing or cfg.precision != "fp32" or cfg.micro_batch or cfg.memory_budget_mb)


def check_memory_config(cfg) -> None:
    """ValueError naming the key and what would be valid; config.validate turns it into a ConfigError."""
    check_precision(cfg.precision)
    per_worker = cfg.global_batch // cfg.workers
    if cfg.micro_batch < 0:
        raise ValueError(f"micro_batch must be >= 0 (0 = the whole per-worker batch); got {cfg.micro_batch}")
    if cfg.micro_batch > per_worker:
        raise ValueError(f"micro_batch ({cfg.micro_batch}) exceeds the per-worker batch global_batch/workers = "
                         f"{per_worker}; use 0 (whole batch) or 1..{per_worker}")
    if cfg.memory_budget_mb < 0:
        raise ValueError(f"memory_budget_mb must be >= 0 (0 = no budget); got {cfg.memory_budget_mb}")
    if cfg.memory_budget_mb and cfg.micro_batch:
        raise ValueError(f"memory_budget_mb={cfg.memory_budget_mb} chooses micro_batch itself; "
                         f"set micro_batch=0 or drop the budget")
    if cfg.activation_checkpointing and cfg.task != "lm":
        raise ValueError("activation_checkpointing recomputes transformer blocks, so it needs task=lm; "
                         "the digits MLP holds too little to matter")
    if cfg.inner_strategy in ("fsdp", "pipeline") and memory_settings_on(cfg):
        raise ValueError(f"activation_checkpointing, precision, micro_batch and memory_budget_mb are not yet "
                         f"wired through inner={cfg.inner_strategy} (FSDP has its own mixed precision and "
                         f"gradient-sync switch; a pipeline owns its own forward and backward and micro-batches); "
                         f"use inner=ddp or single with them")
    if cfg.memory_budget_mb:
        _model_for_check(cfg)  # sizing is cheap (a few small passes): fail before any worker starts


def _model_for_check(cfg) -> None:
    import torch.nn.functional as F

    from islands.models import MLP, ByteTransformer, sequence_loss

    with torch.random.fork_rng():  # validating must not move the caller's random state
        if cfg.task == "lm":
            model, loss_fn = ByteTransformer(cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.context), sequence_loss
        else:
            model, loss_fn = MLP(64, cfg.hidden, 10), F.cross_entropy
        build_forward_backward(cfg, model, loss_fn, optimizer=None)  # AdamW-sized state before one exists


def build_forward_backward(cfg, model: torch.nn.Module, loss_fn, optimizer: torch.optim.Optimizer | None,
                           device: torch.device | str = "cpu") -> ForwardBackward:
    """Call before the strategy wraps the model: checkpointing is set on the plain model, and the sizer
    runs it alone (every rank measures the same shapes, so every rank picks the same micro-batch)."""
    if cfg.activation_checkpointing:
        model.set_activation_checkpointing(len(model.blocks))  # one segment per block (islands.memory.recompute)
    if not cfg.memory_budget_mb:
        return ForwardBackward(cfg.micro_batch, cfg.precision)
    per_worker = cfg.global_batch // cfg.workers
    make = synthetic_batches(cfg.task, cfg.context, device, cfg.seed)
    plan = plan_micro_batch(model, loss_fn, make, per_worker, int(cfg.memory_budget_mb * MB), optimizer,
                            cfg.precision)
    step = ForwardBackward(plan.micro_batch, cfg.precision)
    step.plan = plan
    return step
