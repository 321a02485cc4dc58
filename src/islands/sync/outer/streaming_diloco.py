"""Streaming DiLoCo (SOTA-155, LIT-214): DiLoCo with fragments, overlapped exchanges and 4-bit deltas.

Three changes to DiLoCo, each lowering the PEAK bytes of one synchronisation:
  * the flat parameter vector is split into F equal fragments; fragment p is synced every H steps
    at offset (p+1)*H/F, so one sync carries 1/F of the model and every element is sent exactly
    once per H-step cycle;
  * each fragment's exchange runs in the background while tau more inner steps happen; when it
    lands, the new global fragment is merged into the local one, local <- merge*local + (1-merge)*global
    (LIT-214), or with landing=replay local <- global + (local - local when the delta left): the new
    global plus exactly the tau steps taken since, so no work is counted twice or dropped;
  * the deltas travel as block-scaled 4-bit codes (quant4.py), but the outer step and the global
    model stay fp32; entropy=zstd adds a lossless zstd stage over the codes (zstd4.py), which is
    what takes the per-fragment cut past 8x (the fp32 block scales alone keep plain 4-bit under it).
With fragments=1, tau=0, bits=32 it is exactly plain DiLoCo (the same engine, diloco.py).
"""

from __future__ import annotations

from islands.aggregate.base import Aggregator
from islands.compress.base import Compressor
from islands.sync.outer.diloco import DiLoCo
from islands.sync.outer.outer_opt import DEFAULT_OUTER, DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, OuterOptimizer
from islands.sync.outer.quant4 import Quant4
from islands.sync.outer.zstd4 import Quant4Zstd


class StreamingDiLoCo(DiLoCo):
    name = "streaming-diloco"

    def __init__(self, inner_steps: int = 100, fragments: int = 4, tau: int = 1,
                 merge: float = 0.5, bits: int = 4, block: int = 1024, outer: str | OuterOptimizer = DEFAULT_OUTER,
                 outer_lr: float = DEFAULT_OUTER_LR, momentum: float = DEFAULT_OUTER_MOMENTUM, weight: float = 0.5,
                 compressor: Compressor | None = None, aggregator: Aggregator | None = None, lr_scale: str = "none",
                 entropy: str = "none", landing: str = "mix", outer_schedule: str = "constant",
                 overlap: str = "none"):
        """`inner_steps` H: steps between two syncs of the same fragment. `fragments` F: parameter fragments, synced
        in turn every H/F steps. `tau`: inner steps each fragment's exchange overlaps with (0 = blocking).
        `merge`: landing=mix's weight kept of the local fragment when the new global one arrives; `landing`: mix
        (LIT-214) | replay (global + the tau steps since the send). `bits`: 4 (block-scaled, `block` values per
        fp32 scale) or 32 (plain fp32); `entropy`: none | zstd over the 4-bit codes. The outer optimizer,
        `compressor` (bits=32 only), `aggregator`, `lr_scale`, `outer_schedule` and `overlap` are DiLoCo's (an
        overlap other than none replaces tau: each fragment's exchange runs during the next H steps)."""
        if bits not in (4, 32):
            raise ValueError(f"bits must be 4 or 32, got {bits}")
        if entropy not in ("none", "zstd") or (entropy == "zstd" and bits != 4):
            raise ValueError(f"entropy must be 'none' or 'zstd' (zstd needs bits=4); got entropy={entropy!r}, bits={bits}")
        codec = None
        if bits == 4 and compressor is not None:
            raise ValueError("bits=4 is the built-in quantiser; to use a compressor set bits=32")
        if bits == 4:
            codec = Quant4Zstd(block) if entropy == "zstd" else Quant4(block)
        super().__init__(inner_steps=inner_steps, outer=outer, outer_lr=outer_lr, momentum=momentum,
                         weight=weight, compressor=compressor, aggregator=aggregator, fragments=fragments, tau=tau,
                         merge=merge, codec=codec, lr_scale=lr_scale, landing=landing,
                         outer_schedule=outer_schedule, overlap=overlap)
