"""The compatibility path: DiLoCo's and streaming DiLoCo's keyword options of before the parts, turned into parts.

Before issue #33 DiLoCo took 18 keyword options (five of them strings: overlap, adapt, landing, lr_scale,
outer_schedule) and StreamingDiLoCo re-forwarded 17. They stay the spec strings' keys at the edge
(`--outer diloco:inner_steps=50,outer=nesterov,outer_lr=0.7,momentum=0.9,overlap=eager`): the registry reads
`diloco_parts`' and `streaming_parts`' signatures as the schema, and `DiLoCo.from_options(**options)` builds
from them. Each function checks the options as the old constructor did (the same messages), then returns the new
constructor's arguments:

    outer, outer_lr, momentum, weight, lr_scale, outer_schedule  ->  outer_optimizer=OuterStep(...)
    compressor, aggregator, codec (streaming: bits, block, entropy)  ->  exchange=Exchange(compressor=...)
    fragments, tau, merge, landing, overlap, adapt, deadline  ->  schedule=Rounds() | Fragments(...) |
                                                                   Overlapped(...) | Adaptive(...)
"""

from __future__ import annotations

import math

from islands.aggregate.base import Aggregator
from islands.aggregate.coordinate import Mean
from islands.compress.base import Compressor
from islands.sync.outer.adaptive import ADAPTS, Adaptive
from islands.sync.outer.base import STATISTICS
from islands.sync.outer.eager import OVERLAPS, Overlapped
from islands.sync.outer.exchange import Exchange
from islands.sync.outer.outer_opt import (
    DEFAULT_OUTER,
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
    OuterOptimizer,
    OuterStep,
    build_outer_optimizer,
)
from islands.sync.outer.quant4 import PayloadCodec, Quant4
from islands.sync.outer.rounds import Fragments, Rounds, Schedule
from islands.sync.outer.zstd4 import Quant4Zstd


def diloco_parts(
    inner_steps: int = 100,
    outer: str | OuterOptimizer = DEFAULT_OUTER,
    outer_lr: float = DEFAULT_OUTER_LR,
    momentum: float = DEFAULT_OUTER_MOMENTUM,
    weight: float = 0.5,
    sync_inner_state: bool = False,
    compressor: Compressor | None = None,
    aggregator: Aggregator | None = None,
    fragments: int = 1,
    tau: int = 0,
    merge: float = 0.5,
    codec: PayloadCodec | None = None,
    lr_scale: str = "none",
    landing: str = "mix",
    outer_schedule: str = "constant",
    overlap: str = "none",
    adapt: str = "none",
    deadline: float = 0.0,
    statistics: str = "mean",
) -> dict:
    """`inner_steps` H: inner optimizer steps per round. `outer`: the outer optimizer, nesterov | sgd (heavy
    ball, or plain with momentum=0) | primal, or an object with step(params, delta, lo, hi, lr_scale)
    (islands.outer.OuterSGD, PrimalAveraging); `outer_lr` (default sqrt(2), the best measured; LIT-212: 0.7),
    `momentum` (default 0; LIT-212: 0.9 with outer=nesterov) and
    `weight` (primal's weight of the new iterate, LIT-276) configure the named ones. `sync_inner_state`:
    also average the inner Adam moments each round (SOTA-219 experiment only). `compressor`: compresses the
    exchanged deltas (error feedback per island, islands.compress); `aggregator`: a robust aggregator across
    islands (islands.robust). `fragments`, `tau`, `merge`, `landing`, `codec`: the streaming form
    (streaming_diloco.py). `lr_scale`: none | sqrt-islands (outer_lr times sqrt(M), M islands in the
    exchange). `outer_schedule`: constant | inner (the outer lr follows the inner optimizer's lr). `overlap`: none |
    delayed | eager: each exchange runs during all H inner steps of the next round (per fragment) and lands
    one round late, as is (delayed) or after an eager stand-in step on the island's own delta (eager.py);
    it replaces tau (tau, merge and landing apply to overlap=none). `adapt`: none | speed | deadline: islands of
    different speeds take different inner steps per round and their deltas are weighted by samples (adaptive.py;
    speed: the fastest island takes H steps, the others in proportion to their measured speed; deadline: each
    island steps until a wall-clock budget per round runs out); `deadline`: adapt=deadline's budget in seconds
    (0: the fastest island's measured time for H steps). `statistics`: mean | own: what a sync does with the
    model's buffers (BatchNorm's running statistics): mean averages them over the islands (the default), own keeps
    each island's own through the end (islands whose inputs differ, as FedBN argues)."""
    if statistics not in STATISTICS:
        raise ValueError(f"statistics must be one of {', '.join(STATISTICS)}, got {statistics!r}")
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap must be one of {', '.join(OVERLAPS)}; got {overlap!r}")
    if overlap != "none" and sync_inner_state:
        raise ValueError("sync_inner_state needs overlap=none (plain DiLoCo)")
    if adapt not in ADAPTS:
        raise ValueError(f"adapt must be one of {', '.join(ADAPTS)}; got {adapt!r}")
    if not (deadline >= 0 and math.isfinite(deadline)):
        raise ValueError(f"deadline must be >= 0 seconds (0: the fastest island's time for H steps); got {deadline}")
    if deadline > 0 and adapt != "deadline":
        raise ValueError(f"deadline={deadline} applies to adapt=deadline only; got adapt={adapt!r}")
    if adapt != "none":
        clash = [
            f"{k}={v}"
            for k, v, plain in (
                ("fragments", fragments, 1),
                ("tau", tau, 0),
                ("sync_inner_state", bool(sync_inner_state), False),
            )
            if v != plain
        ]
        if clash:
            raise ValueError(
                f"adapt={adapt} runs whole-model DiLoCo rounds (fragments=1, tau=0, "
                f"sync_inner_state=0; overlap=eager|delayed is fine); drop {', '.join(clash)}"
            )
        if aggregator is not None and not isinstance(aggregator, Mean):
            raise ValueError(
                f"adapt={adapt} weighs each island's delta by its samples; a robust aggregator has no "
                "such weights: drop aggregator= or use adapt=none"
            )
    if overlap != "none":
        tau = 0  # the exchange lands a whole round later instead
    if outer_schedule not in ("constant", "inner"):
        raise ValueError(f"outer_schedule must be 'constant' or 'inner', got {outer_schedule!r}")
    if landing not in ("mix", "replay"):
        raise ValueError(f"landing must be 'mix' or 'replay', got {landing!r}")
    if lr_scale not in ("none", "sqrt-islands"):
        raise ValueError(f"lr_scale must be 'none' or 'sqrt-islands', got {lr_scale!r}")
    if inner_steps < 1 or fragments < 1 or fragments > inner_steps:
        raise ValueError(f"need 1 <= fragments <= inner_steps; got fragments={fragments}, inner_steps={inner_steps}")
    if not 0 <= tau < inner_steps:
        raise ValueError(f"tau must be in [0, inner_steps); got tau={tau}, inner_steps={inner_steps}")
    if sync_inner_state and (fragments > 1 or tau > 0):
        raise ValueError("sync_inner_state needs fragments=1 and tau=0 (plain DiLoCo)")
    if not 0 <= merge < 1:
        raise ValueError(f"merge must be in [0, 1), got {merge}")
    if compressor is not None and codec is not None:
        raise ValueError(
            "a compressor and the built-in 4-bit codec together are not supported; pick one "
            "(streaming DiLoCo: bits=32 with a compressor)"
        )
    opt = outer if not isinstance(outer, str) else build_outer_optimizer(outer, outer_lr, momentum, weight)
    schedule: Schedule
    if adapt != "none":
        schedule = Adaptive(adapt, deadline, overlap=overlap)
    elif overlap != "none":
        schedule = Overlapped(overlap, fragments=int(fragments))
    elif fragments == 1 and tau == 0:
        schedule = Rounds()
    else:
        schedule = Fragments(int(fragments), int(tau), merge, landing)
    return {
        "inner_steps": int(inner_steps),
        "outer_optimizer": OuterStep(
            opt, sqrt_islands=lr_scale == "sqrt-islands", follow_inner_lr=outer_schedule == "inner"
        ),
        "exchange": Exchange("outer_delta", aggregator=aggregator, compressor=codec or compressor),
        "schedule": schedule,
        "sync_inner_state": bool(sync_inner_state),
        "statistics": statistics,
    }


def streaming_parts(
    inner_steps: int = 100,
    fragments: int = 4,
    tau: int = 1,
    merge: float = 0.5,
    bits: int = 4,
    block: int = 1024,
    outer: str | OuterOptimizer = DEFAULT_OUTER,
    outer_lr: float = DEFAULT_OUTER_LR,
    momentum: float = DEFAULT_OUTER_MOMENTUM,
    weight: float = 0.5,
    compressor: Compressor | None = None,
    aggregator: Aggregator | None = None,
    lr_scale: str = "none",
    entropy: str = "none",
    landing: str = "mix",
    outer_schedule: str = "constant",
    overlap: str = "none",
    statistics: str = "mean",
) -> dict:
    """`inner_steps` H: steps between two syncs of the same fragment. `fragments` F: parameter fragments, synced
    in turn every H/F steps. `tau`: inner steps each fragment's exchange overlaps with (0 = blocking).
    `merge`: landing=mix's weight kept of the local fragment when the new global one arrives; `landing`: mix
    (LIT-214) | replay (global + the tau steps since the send). `bits`: 4 (block-scaled, `block` values per
    fp32 scale) or 32 (plain fp32); `entropy`: none | zstd over the 4-bit codes. The outer optimizer,
    `compressor` (bits=32 only), `aggregator`, `lr_scale`, `outer_schedule`, `overlap` and `statistics` are DiLoCo's (an
    overlap other than none replaces tau: each fragment's exchange runs during the next H steps)."""
    if bits not in (4, 32):
        raise ValueError(f"bits must be 4 or 32, got {bits}")
    if entropy not in ("none", "zstd") or (entropy == "zstd" and bits != 4):
        raise ValueError(f"entropy must be 'none' or 'zstd' (zstd needs bits=4); got entropy={entropy!r}, bits={bits}")
    if bits == 4 and compressor is not None:
        raise ValueError("bits=4 is the built-in quantiser; to use a compressor set bits=32")
    codec = streaming_codec(bits, block, entropy)
    return diloco_parts(
        inner_steps=inner_steps,
        outer=outer,
        outer_lr=outer_lr,
        momentum=momentum,
        weight=weight,
        compressor=compressor,
        aggregator=aggregator,
        fragments=fragments,
        tau=tau,
        merge=merge,
        codec=codec,
        lr_scale=lr_scale,
        landing=landing,
        outer_schedule=outer_schedule,
        overlap=overlap,
        statistics=statistics,
    )


def streaming_codec(bits: int = 4, block: int = 1024, entropy: str = "none") -> PayloadCodec | None:
    """Streaming DiLoCo's bits/entropy spelling as the exchange's compressor: Quant4, Quant4Zstd, or None (fp32)."""
    if bits == 32:
        return None
    return Quant4Zstd(block) if entropy == "zstd" else Quant4(block)
