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

from islands.sync.outer.diloco import DiLoCo
from islands.sync.outer.quant4 import Quant4
from islands.sync.outer.zstd4 import Quant4Zstd


class StreamingDiLoCo(DiLoCo):
    name = "streaming-diloco"

    def __init__(self, total_steps: int, inner_steps: int = 100, fragments: int = 4, tau: int = 1,
                 merge: float = 0.5, bits: int = 4, block: int = 1024, outer: str = "nesterov",
                 outer_lr: float = 0.7, momentum: float = 0.9, weight: float = 0.5,
                 compress: str = "none", aggregate: str = "mean", lr_scale: str = "none", entropy: str = "none",
                 landing: str = "mix", outer_schedule: str = "constant"):
        if bits not in (4, 32):
            raise ValueError(f"bits must be 4 or 32, got {bits}")
        if entropy not in ("none", "zstd") or (entropy == "zstd" and bits != 4):
            raise ValueError(f"entropy must be 'none' or 'zstd' (zstd needs bits=4); got entropy={entropy!r}, bits={bits}")
        codec = None
        if bits == 4:
            codec = Quant4Zstd(block) if entropy == "zstd" else Quant4(block)
        super().__init__(total_steps, inner_steps=inner_steps, outer=outer, outer_lr=outer_lr, momentum=momentum,
                         weight=weight, compress=compress, aggregate=aggregate, fragments=fragments, tau=tau,
                         merge=merge, codec=codec, lr_scale=lr_scale, landing=landing,
                         outer_schedule=outer_schedule)
