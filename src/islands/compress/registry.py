"""The compressors by spec name (islands.spec): each constructor's signature is the spec's schema.

    COMPRESSORS.build("powersgd:rank=4,bits=16")      PowerSGD(rank=4, bits=16), error feedback wish ef=True
    COMPRESSORS.build("topk:ratio=0.01,momentum=0.9") TopK with DGC's warm-up, momentum correction on the residual

Error feedback (`ef`) is each constructor's own default: on for the biased compressors (topk, sign, powersgd), off
for the unbiased or near-exact ones (SOTA-214). The strategies wrap a compressor in ErrorFeedback where it asks
(islands.compress.error_feedback.with_error_feedback).
"""

from __future__ import annotations

import torch

from islands.compress.base import Compressor, CompressorBase
from islands.compress.cast import Cast
from islands.compress.dct import DCTTopK
from islands.compress.identity import NoCompression
from islands.compress.powersgd import PowerSGD
from islands.compress.quantize import QSGD, SharedScaleQuant
from islands.compress.randomk import RandomK
from islands.compress.randomk_shared import SharedRandomK
from islands.compress.sign import MajorityVote
from islands.compress.topk import TopK
from islands.compress.topkq import TopKQ
from islands.compress.torch_powersgd import TorchPowerSGD
from islands.spec import Registry, bind

COMPRESSORS = Registry(
    "compressor",
    {
        "none": NoCompression,
        "fp16": bind(
            Cast,
            torch.float16,
            doc="Each value cast to fp16 on the wire, prescaled by 1/ranks so the sum "
            "cannot overflow; `ef`: error feedback around it.",
        ),
        "bf16": bind(Cast, torch.bfloat16, doc="Each value cast to bf16 on the wire; `ef`: error feedback around it."),
        "int8": bind(
            SharedScaleQuant,
            8,
            doc="int8 codes against one scale every rank agrees on, summable; "
            "`seed`: rounding RNG seed. `ef`: error feedback around it.",
        ),
        "int4": bind(
            SharedScaleQuant,
            4,
            doc="int4 codes against one scale every rank agrees on (at most 7 ranks); "
            "`seed`: rounding RNG seed. `ef`: error feedback around it.",
        ),
        "qsgd": QSGD,
        "randomk": RandomK,
        # DGC's sparsity warm-up is on in the spec form (the constructor leaves it off for direct use)
        "topk": bind(TopK, warmup=True),
        "powersgd": PowerSGD,
        "sign": MajorityVote,
        "torch-powersgd": TorchPowerSGD,
        # pseudo-gradient compressors for the outer strategies (issue 19): SparseLoCo's, DeMo's, shared random-k
        "topkq": TopKQ,
        "dct-topk": DCTTopK,
        "randomk-shared": SharedRandomK,
    },
    base=(Compressor, CompressorBase),
    aliases={"stage_steps": "steps_per_stage"},
)
