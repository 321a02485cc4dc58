"""Compressed communication with error feedback: one Compressor contract, many compressors.

    from islands.compress import parse_compressor, compress_and_average, ddp_comm_hook
    c = parse_compressor("powersgd:rank=4")          # ErrorFeedback(PowerSGD(rank=4))
    means = compress_and_average(named_grads, world.comm("local"), c)
    state, hook = ddp_comm_hook(c, world.comm("local"), model.named_parameters())
    ddp_model.register_comm_hook(state, hook)

See docs/compression.md for the policies (NaN/Inf, empty, non-contiguous, dtypes) and practice ids.
"""

from islands.compress.average import analytic_nbytes, compress_and_average
from islands.compress.base import (
    Agreed,
    Combine,
    Compressor,
    CompressorBase,
    NonFiniteGradientError,
    Payload,
    all_finite,
)
from islands.compress.cast import Cast
from islands.compress.dct import DCTTopK
from islands.compress.ddp_hook import CompressionHookState, ddp_comm_hook
from islands.compress.dgc import deep_gradient_compression
from islands.compress.error_feedback import ErrorFeedback
from islands.compress.identity import NoCompression
from islands.compress.onebit_adam import NaiveCompressedAdam, OneBitAdam
from islands.compress.powersgd import PowerSGD
from islands.compress.quantize import QSGD, SharedScaleQuant
from islands.compress.randomk import RandomK
from islands.compress.randomk_shared import SharedRandomK
from islands.compress.registry import COMPRESSORS
from islands.compress.sign import MajorityVote, ScaledSign
from islands.compress.spec import parse_compressor
from islands.compress.topk import DGC_SPARSITY_WARMUP, TopK
from islands.compress.topkq import TopKQ

__all__ = [
    "Agreed",
    "Cast",
    "Combine",
    "CompressionHookState",
    "Compressor",
    "CompressorBase",
    "DCTTopK",
    "DGC_SPARSITY_WARMUP",
    "ErrorFeedback",
    "MajorityVote",
    "NaiveCompressedAdam",
    "NoCompression",
    "NonFiniteGradientError",
    "OneBitAdam",
    "Payload",
    "PowerSGD",
    "QSGD",
    "RandomK",
    "COMPRESSORS",
    "ScaledSign",
    "SharedRandomK",
    "SharedScaleQuant",
    "TopK",
    "TopKQ",
    "all_finite",
    "analytic_nbytes",
    "compress_and_average",
    "ddp_comm_hook",
    "deep_gradient_compression",
    "parse_compressor",
]
