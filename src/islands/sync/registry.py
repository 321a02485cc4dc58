"""Build the strategy stack a config asks for, and check spec strings before any worker starts."""

from __future__ import annotations

from islands.config import TrainConfig
from islands.runtime.world import World
from islands.sync.base import Stack, Strategy
from islands.sync.ddp import DDP
from islands.sync.single import Single


def check_specs(cfg: TrainConfig) -> None:
    """Parse every spec string once; each package raises ValueError listing its valid choices."""
    if cfg.compress not in ("", "none"):
        from islands.compress import parse_compressor
        from islands.compress.torch_powersgd import is_torch_powersgd, parse_torch_powersgd

        if is_torch_powersgd(cfg.compress):
            parse_torch_powersgd(cfg.compress)
        else:
            parse_compressor(cfg.compress)
    from islands.compress.optim import parse_optimizer

    if parse_optimizer(cfg.optimizer).communicates and (
            cfg.compress not in ("", "none") or cfg.aggregate not in ("", "mean") or cfg.attack):
        raise ValueError(f"optimizer={cfg.optimizer!r} averages 1-bit momentum itself, so there is no gradient "
                         "exchange to compress or aggregate; leave compress='none', aggregate='mean', attack=''")
    if cfg.aggregate not in ("", "mean"):
        from islands.aggregate import parse_aggregator

        parse_aggregator(cfg.aggregate)
    if cfg.attack:
        from islands.faults.attacks import parse_attack

        parse_attack(cfg.attack, world_size=cfg.workers)
    if cfg.outer:
        from islands.sync.outer import parse_outer

        warm = dict(parse_outer(cfg.outer).params).get("warm_start", 0)
        if warm >= cfg.steps:  # caught here, before any worker starts, not in the workers
            raise ValueError(f"outer warm_start ({warm}) must be < steps ({cfg.steps}) so that some steps are "
                             "left for the outer rounds")
    if cfg.islands > 1 and not cfg.outer and cfg.inner_strategy != "fsdp":  # fsdp: HSDP across islands
        raise ValueError(
            f"islands={cfg.islands} needs an outer strategy to meet across islands, "
            "e.g. outer='diloco:inner_steps=100' or outer='local-sgd:every=8'; or use islands=1"
        )
    _check_fsdp(cfg)
    from islands.parallel.pipeline.setup import check_pipeline_config

    check_pipeline_config(cfg)
    if cfg.outer and cfg.islands == 1 and cfg.workers > 1 and cfg.inner_strategy == "ddp":
        raise ValueError(
            "an outer strategy acts across islands, but islands=1 puts every worker in one island; "
            f"set islands={cfg.workers} (one worker per island) or a divisor of workers"
        )


def _check_fsdp(cfg: TrainConfig) -> None:
    from islands.sync.wrap_policy import parse_wrap

    from islands.sync.shard_group import check_group, parse_shard_group

    parse_wrap(cfg.wrap)  # always: a typo is reported even before inner=fsdp is chosen
    group = parse_shard_group(cfg.shard_group)
    if cfg.inner_strategy == "zero1" and (cfg.compress not in ("", "none") or cfg.aggregate not in ("", "mean")
                                          or cfg.attack or _optimizer_communicates(cfg)):
        raise ValueError("inner=zero1 partitions an ordinary optimizer over DDP's plain mean; compress, aggregate, "
                         "attack and 1-bit optimizers are wired for inner=ddp only")
    if cfg.inner_strategy != "fsdp":
        if group != "" or cfg.prefetch or cfg.shard_budget_mb:
            raise ValueError(f"shard_group={cfg.shard_group!r}, shard_budget_mb and prefetch={cfg.prefetch} "
                             "apply to inner=fsdp only")
        return
    if isinstance(group, int):
        check_group(group, cfg.workers)
    if cfg.shard_budget_mb and group != "auto":
        raise ValueError("shard_budget_mb is the budget of shard_group='auto'; set shard_group='auto' or drop it")
    from islands.compress.optim import parse_optimizer

    clash = [f"{k}={getattr(cfg, k)!r}" for k, ok in (("compress", ("", "none")), ("aggregate", ("", "mean")),
                                                      ("attack", ("",)), ("outer", ("",)))
             if getattr(cfg, k) not in ok]
    if parse_optimizer(cfg.optimizer).communicates:
        clash.append(f"optimizer={cfg.optimizer!r}")
    if clash:  # FSDP owns its reduce-scatter; these act on a replicated gradient or a full local model
        raise ValueError(f"inner=fsdp shards gradients and parameters, so it does not combine with "
                         f"{', '.join(clash)}; use inner=ddp for those, or drop them")


def _optimizer_communicates(cfg: TrainConfig) -> bool:
    from islands.compress.optim import parse_optimizer

    return parse_optimizer(cfg.optimizer).communicates


def build_inner(cfg: TrainConfig, world: World) -> Strategy:
    if cfg.inner_strategy == "single":
        return Single()
    if cfg.inner_strategy == "pipeline":  # its loop is islands.parallel.pipeline.trainer
        from islands.parallel.pipeline.setup import pipeline_from_config

        return pipeline_from_config(cfg)
    if cfg.inner_strategy == "fsdp":
        from islands.sync.sharded import FSDP

        return FSDP(wrap=cfg.wrap, reshard_after_forward=cfg.reshard, grad_clip=cfg.grad_clip > 0,
                    prefetch=cfg.prefetch, shard_group=cfg.shard_group,
                    memory_budget_bytes=int(cfg.shard_budget_mb * 2**20))
    from islands.compress.optim import OptimizerSynced, parse_optimizer

    opt = parse_optimizer(cfg.optimizer)
    if opt.communicates:  # the optimizer averages across the island itself (SOTA-215)
        return OptimizerSynced(opt.name)
    from islands.compress.torch_powersgd import SINGLE_BUCKET_MB, is_torch_powersgd, torch_powersgd_hook_factory

    if is_torch_powersgd(cfg.compress):  # one bucket: torch's hook crashes on gloo with more (FACTS.md)
        return DDP(bucket_mb=max(cfg.bucket_mb, SINGLE_BUCKET_MB), hook_factory=torch_powersgd_hook_factory(cfg.compress, cfg.seed))
    if cfg.inner_strategy == "zero1":  # DDP's exchange, optimizer state partitioned (SOTA-028)
        from islands.sync.zero1 import ZeRO1

        return ZeRO1(DDP(bucket_mb=cfg.bucket_mb))
    hook_factory = None
    if cfg.compress not in ("", "none") or cfg.aggregate not in ("", "mean") or cfg.attack:
        from islands.sync.exchange import bucket_hook_factory

        hook_factory = bucket_hook_factory(cfg, world)
    return DDP(bucket_mb=cfg.bucket_mb, hook_factory=hook_factory)


def build_strategy(cfg: TrainConfig, world: World) -> Stack:
    inner = build_inner(cfg, world)
    outer = None
    if cfg.outer:
        from islands.sync.outer import build_outer

        outer = build_outer(cfg, world)
    return Stack(inner, outer)
