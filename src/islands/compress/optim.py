"""Optimizer specs for the trainer: "adamw", "onebit-adam[:warmup=N]", "naive-compressed-adam[:warmup=N]",
"split-adamw[:variance=local,every=K,clip=C,compress=powersgd,rank=r,bits=b,dense_bits=d]".

The 1-bit optimizers (SOTA-215, LIT-278) average across ranks themselves, so the inner strategy must
not all-reduce gradients as well: `OptimizerSynced` is that inner strategy. It only makes every rank
start from rank 0's parameters (one counted broadcast in `wrap`); from then on the optimizer's
averaged momentum keeps the replicas identical.

    spec = parse_optimizer("onebit-adam:warmup=50")
    opt = build_optimizer(spec, model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
                          steps=300, comm=world.comm("local"))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from islands.compress.onebit_adam import NaiveCompressedAdam, OneBitAdam
from islands.compress.split_adam import VARIANCE_SOURCES, SplitMomentAdamW
from islands.runtime.comm import Comm
from islands.sync.base import NoOp

OPTIMIZERS = {
    "adamw": None,  # torch.optim.AdamW; gradients averaged by the inner strategy
    "onebit-adam": OneBitAdam,
    "naive-compressed-adam": NaiveCompressedAdam,  # negative control only
    "split-adamw": SplitMomentAdamW,  # PowerSGD-compressed first moment, separately sourced variance
}
# split-adamw's parameters: (type, default, help). The PowerSGD ones build its compressor.
SPLIT_PARAMS = {
    "variance": (str, "local", f"second-moment source: {'|'.join(VARIANCE_SOURCES)}"),
    "every": (int, 20, "steps between bf16 all-reduces of the workers' local variance (variance=local)"),
    "clip": (float, 1.0, "max global norm of the averaged gradient (run the trainer with grad_clip=0)"),
    "rank": (int, 4, "PowerSGD rank of the first moment's gradient"),
    "bits": (int, 32, "PowerSGD factor precision: 32 fp32, 16 bf16"),
    "dense_bits": (int, 32, "precision of biases/norms sent uncompressed: 32, 16 (bf16)"),
}
# Our default warm-up: a fifth of the run uncompressed, so the frozen variance has seen real data.
DEFAULT_WARMUP_FRACTION = 0.2


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    warmup: int | None = None  # steps of uncompressed Adam before 1-bit; None = a fifth of the run
    options: tuple[tuple[str, object], ...] = ()  # split-adamw's SPLIT_PARAMS, as (key, value) pairs

    @property
    def communicates(self) -> bool:
        """True when the optimizer averages across ranks itself (no gradient all-reduce wanted)."""
        return OPTIMIZERS[self.name] is not None

    def warmup_steps(self, steps: int) -> int:
        return self.warmup if self.warmup is not None else max(1, int(steps * DEFAULT_WARMUP_FRACTION))


def describe_optimizers() -> str:
    split = ",".join(f"{k}={d}" for k, (_, d, _) in SPLIT_PARAMS.items())
    return ("valid optimizers: adamw | onebit-adam[:warmup=N] | naive-compressed-adam[:warmup=N] "
            f"(warmup: uncompressed Adam steps before 1-bit momentum, default {DEFAULT_WARMUP_FRACTION:g} x steps) | "
            f"split-adamw[:{split}] (" + "; ".join(f"{k}: {h}" for k, (_, _, h) in SPLIT_PARAMS.items()) + ")")


def _parse_split(rest: str) -> tuple[tuple[str, object], ...]:
    values = {k: d for k, (_, d, _) in SPLIT_PARAMS.items()}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, raw = (x.strip() for x in item.partition("="))
        if not eq or key not in SPLIT_PARAMS:
            raise ValueError(f"optimizer 'split-adamw' has no parameter {item!r}; {describe_optimizers()}")
        typ = SPLIT_PARAMS[key][0]
        try:
            values[key] = int(raw, 10) if typ is int else typ(raw)
        except ValueError:
            raise ValueError(f"optimizer 'split-adamw': {key}={raw!r} is not a valid {typ.__name__}") from None
    if values["variance"] not in VARIANCE_SOURCES:
        raise ValueError(f"optimizer 'split-adamw': variance must be one of {VARIANCE_SOURCES}, got {values['variance']!r}")
    if values["every"] < 1 or values["clip"] < 0:
        raise ValueError(f"optimizer 'split-adamw': need every >= 1 and clip >= 0, got every={values['every']}, clip={values['clip']}")
    _split_compressor(values)  # bad PowerSGD parameters fail here, at parse time
    return tuple(values.items())


def _split_compressor(values: dict):
    from islands.compress.spec import parse_compressor

    return parse_compressor(f"powersgd:rank={values['rank']},bits={values['bits']},dense_bits={values['dense_bits']}")


def parse_optimizer(spec: str) -> OptimizerSpec:
    if not isinstance(spec, str):
        raise TypeError(f"optimizer spec must be a str such as 'onebit-adam:warmup=50', got {type(spec).__name__}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; {describe_optimizers()}")
    if name == "split-adamw":
        return OptimizerSpec(name, options=_parse_split(rest))
    warmup = None
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, raw = item.partition("=")
        if name == "adamw" or key.strip() != "warmup" or not eq:
            raise ValueError(f"optimizer {name!r} has no parameter {item!r}; {describe_optimizers()}")
        try:
            warmup = int(raw.strip(), 10)
        except ValueError:
            raise ValueError(f"optimizer {name!r}: warmup={raw.strip()!r} is not an integer") from None
        if warmup < 1:
            raise ValueError(f"optimizer {name!r}: warmup must be >= 1 (the variance needs data), got {warmup}")
    return OptimizerSpec(name, warmup)


def build_optimizer(spec: OptimizerSpec | str, params, *, lr: float, betas=(0.9, 0.95), weight_decay: float = 0.0,
                    steps: int = 1, comm: Comm | None = None) -> torch.optim.Optimizer:
    """The torch optimizer a spec names; `comm` (the local group) is used by the 1-bit ones."""
    spec = parse_optimizer(spec) if isinstance(spec, str) else spec
    cls = OPTIMIZERS[spec.name]
    if cls is None:
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if cls is SplitMomentAdamW:
        o = dict(spec.options)
        return SplitMomentAdamW(params, _split_compressor(o), comm, lr=lr, betas=betas, weight_decay=weight_decay,
                                variance=o["variance"], variance_every=o["every"], clip=o["clip"])
    return cls(params, lr=lr, betas=betas, weight_decay=weight_decay, warmup_steps=spec.warmup_steps(steps), comm=comm)


class OptimizerSynced(NoOp):
    """Inner strategy for optimizers that communicate: no gradient exchange, one parameter broadcast.

    The broadcast (kind "param_broadcast", from the island's first rank) makes identical starting
    points a fact rather than an assumption about seeds.
    """

    def __init__(self, optimizer_name: str):
        self.name = f"synced-by-{optimizer_name}"

    def wrap(self, model, optimizer, world):
        if world.workers_per_island == 1:
            return model
        comm = world.comm("local")
        src = world.island * world.workers_per_island  # global rank of this island's first worker
        with torch.no_grad():
            for t in list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]:
                comm.broadcast(t.data, src=src, kind="param_broadcast")
        return model
