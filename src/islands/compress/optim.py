"""Optimizer specs for the trainer: "adamw", "onebit-adam[:warmup=N]", "naive-compressed-adam[:warmup=N]",
"split-adamw[:variance=local,every=K,clip=C,rank=r,bits=b,dense_bits=d]", "muon[:momentum=m,...]" (torch's Muon on the
hidden matrices, AdamW on the rest: islands.optim.MuonAdamW) (OPTIMIZERS, islands.spec: each recipe's
signature is the schema). A spec builds an OptimizerSpec, the recipe; build_optimizer makes the torch optimizer
once the parameters, lr and comm are known.

The 1-bit optimizers (SOTA-215, LIT-278) average across ranks themselves, so the inner strategy must
not all-reduce gradients as well: `islands.inner.DDP` sees a CommunicatingOptimizer and only makes
every rank start from the island's first rank's parameters (one counted broadcast in `wrap`); from then
on the optimizer's averaged momentum keeps the replicas identical.

    spec = parse_optimizer("onebit-adam:warmup=50")
    opt = build_optimizer(spec, model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
                          steps=300, comm=world.comm("local"))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from islands.compress.error_feedback import with_error_feedback
from islands.compress.onebit_adam import NaiveCompressedAdam, OneBitAdam
from islands.compress.powersgd import PowerSGD
from islands.compress.split_adam import VARIANCE_SOURCES, SplitMomentAdamW
from islands.optim.fused import fused_adamw
from islands.optim.muon import ADJUST_LR, MuonAdamW
from islands.runtime.contracts import Collectives
from islands.spec import Registry, Spec

# Our default warm-up: a fifth of the run uncompressed, so the frozen variance has seen real data.
DEFAULT_WARMUP_FRACTION = 0.2
_CLASSES: dict[str, type[OneBitAdam] | type[NaiveCompressedAdam] | type[SplitMomentAdamW] | None] = {
    "adamw": None,  # torch.optim.AdamW; gradients averaged by the inner strategy
    "onebit-adam": OneBitAdam,
    "naive-compressed-adam": NaiveCompressedAdam,  # negative control only
    "split-adamw": SplitMomentAdamW,  # PowerSGD-compressed first moment, separately sourced variance
    "muon": None,  # islands.optim.MuonAdamW; local like adamw: the inner strategy averages the gradients
}


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    warmup: int | None = None  # steps of uncompressed Adam before 1-bit; None = a fifth of the run
    options: tuple[tuple[str, Any], ...] = ()  # split-adamw's parameters, as (key, value) pairs

    @property
    def communicates(self) -> bool:
        """True when the optimizer averages across ranks itself (no gradient all-reduce wanted)."""
        return _CLASSES[self.name] is not None

    def warmup_steps(self, steps: int) -> int:
        return self.warmup if self.warmup is not None else max(1, int(steps * DEFAULT_WARMUP_FRACTION))


def adamw() -> OptimizerSpec:
    """torch's AdamW (fused when every parameter is on CUDA); the inner strategy averages the gradients."""
    return OptimizerSpec("adamw")


def _warmup(name: str, warmup: int | None) -> OptimizerSpec:
    if warmup is not None and warmup < 1:
        raise ValueError(f"optimizer {name!r}: warmup must be >= 1 (the variance needs data), got {warmup}")
    return OptimizerSpec(name, warmup)


def onebit_adam(warmup: int | None = None) -> OptimizerSpec:
    """1-bit Adam (LIT-278, SOTA-215): Adam whose variance freezes after the warm-up; then 1-bit error-compensated
    momentum, averaged across the island. `warmup`: uncompressed Adam steps before 1-bit momentum; none = a fifth
    of the run."""
    return _warmup("onebit-adam", warmup)


def naive_compressed_adam(warmup: int | None = None) -> OptimizerSpec:
    """NEGATIVE CONTROL ONLY (SOTA-215): Adam whose update is compressed to 1 bit directly after the warm-up.
    `warmup`: uncompressed Adam steps before compression; none = a fifth of the run."""
    return _warmup("naive-compressed-adam", warmup)


def split_adamw(
    variance: str = "local", every: int = 20, clip: float = 1.0, rank: int = 4, bits: int = 32, dense_bits: int = 32
) -> OptimizerSpec:
    """AdamW whose first moment takes the PowerSGD-compressed average, its variance a separate source.
    `variance`: the second-moment source, compressed | exact | local. `every`: steps between bf16 all-reduces of
    the workers' local variance (variance=local). `clip`: max global norm of the averaged gradient (run the
    trainer with grad_clip=0). `rank`: PowerSGD rank of the first moment's gradient. `bits`: PowerSGD factor
    precision, 32 fp32 or 16 bf16. `dense_bits`: precision of biases/norms sent uncompressed, 32 or 16 (bf16)."""
    if variance not in VARIANCE_SOURCES:
        raise ValueError(f"optimizer 'split-adamw': variance must be one of {VARIANCE_SOURCES}, got {variance!r}")
    if every < 1 or clip < 0:
        raise ValueError(f"optimizer 'split-adamw': need every >= 1 and clip >= 0, got every={every}, clip={clip}")
    options = dict(variance=variance, every=every, clip=clip, rank=rank, bits=bits, dense_bits=dense_bits)
    _split_compressor(options)  # bad PowerSGD parameters fail here, at parse time
    return OptimizerSpec("split-adamw", options=tuple(options.items()))


def muon(
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    adjust_lr: str = "match_rms_adamw",
    lr_ratio: float = 1.0,
) -> OptimizerSpec:
    """torch's Muon on the hidden weight matrices, AdamW on embeddings, the head, biases and norms (islands.optim).
    `momentum`: Muon's momentum (0.95, Keller Jordan's and torch's default). `nesterov`: Nesterov momentum in Muon.
    `ns_steps`: Newton-Schulz iterations per update. `adjust_lr`: match_rms_adamw (Liu et al. 2025: update RMS as
    AdamW's, so the job's lr and weight decay carry over) | original (Keller Jordan's; wants lr_ratio near 10).
    `lr_ratio`: Muon's lr over the job's lr."""
    if not 0 <= momentum < 1 or ns_steps < 1 or not lr_ratio > 0:
        raise ValueError(
            f"optimizer 'muon': need 0 <= momentum < 1, ns_steps >= 1 and lr_ratio > 0; got "
            f"momentum={momentum}, ns_steps={ns_steps}, lr_ratio={lr_ratio}"
        )
    if adjust_lr not in ADJUST_LR:
        raise ValueError(f"optimizer 'muon': adjust_lr must be one of {ADJUST_LR}, got {adjust_lr!r}")
    options = dict(momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, adjust_lr=adjust_lr, lr_ratio=lr_ratio)
    return OptimizerSpec("muon", options=tuple(options.items()))


OPTIMIZERS = Registry(
    "optimizer",
    {
        "adamw": adamw,
        "onebit-adam": onebit_adam,
        "naive-compressed-adam": naive_compressed_adam,
        "split-adamw": split_adamw,
        "muon": muon,
    },
)


def describe_optimizers() -> str:
    return OPTIMIZERS.describe()


def _split_compressor(values: dict):
    return with_error_feedback(PowerSGD(rank=values["rank"], bits=values["bits"], dense_bits=values["dense_bits"]))


def parse_optimizer(spec: str | Spec) -> OptimizerSpec:
    """The optimizer a spec names, as an OptimizerSpec (what to build once the parameters and lr are known)."""
    return OPTIMIZERS.build(spec)


def build_optimizer(
    spec: OptimizerSpec | str,
    params,
    *,
    lr: float,
    betas=(0.9, 0.95),
    weight_decay: float = 0.0,
    steps: int = 1,
    comm: Collectives | None = None,
    model: torch.nn.Module | None = None,
) -> torch.optim.Optimizer:
    """The torch optimizer a spec names; `comm` (the local group) is used by the 1-bit ones; `model` by muon, which
    splits the model's parameters itself (islands.optim.muon_split; `params` is then unused)."""
    spec = parse_optimizer(spec) if isinstance(spec, str) else spec
    if spec.name == "muon":
        if model is None:
            raise ValueError(
                "optimizer 'muon' needs the model (build_optimizer(..., model=model)): it tells the hidden "
                "weight matrices, which Muon takes, from embeddings and the output head, which AdamW takes"
            )
        o = dict(spec.options)
        return MuonAdamW.for_model(
            model,
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
            momentum=o["momentum"],
            nesterov=o["nesterov"],
            ns_steps=o["ns_steps"],
            adjust_lr_fn=o["adjust_lr"],
            muon_lr_ratio=o["lr_ratio"],
        )
    cls = _CLASSES[spec.name]
    if cls is None:
        params = list(params)  # read twice: where the parameters live, then by the optimizer
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused_adamw(params))
    if issubclass(cls, SplitMomentAdamW):
        o = dict(spec.options)
        return SplitMomentAdamW(
            params,
            _split_compressor(o),
            comm,
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
            variance=o["variance"],
            variance_every=o["every"],
            clip=o["clip"],
        )
    return cls(params, lr=lr, betas=betas, weight_decay=weight_decay, warmup_steps=spec.warmup_steps(steps), comm=comm)
