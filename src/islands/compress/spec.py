"""Compressor specs as strings ("powersgd:rank=4", "topk:ratio=0.001,warmup=1", "sign,ef=0") -> objects.

Error feedback is on by default for the biased compressors (topk, sign, powersgd), off for the
unbiased or near-exact ones (randomk, qsgd, int8, int4, fp16, bf16, none), and switchable with
ef=0/1 for any of them (SOTA-214). topk also takes DGC's momentum and clip, which need ef=1.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from islands.compress.base import CompressorBase
from islands.compress.cast import Cast
from islands.compress.error_feedback import ErrorFeedback
from islands.compress.identity import NoCompression
from islands.compress.powersgd import PowerSGD
from islands.compress.quantize import QSGD, SharedScaleQuant
from islands.compress.randomk import RandomK
from islands.compress.sign import MajorityVote
from islands.compress.topk import TopK

# name -> (builder, {param: (type, default, help)}, error feedback on by default)
_P = dict[str, tuple[type, Any, str]]
_EF: _P = {"ef": (int, None, "1/0: wrap in ErrorFeedback")}
_DGC: _P = {
    "momentum": (float, 0.0, "DGC momentum correction (optimizer momentum must then be 0)"),
    "clip": (float, None, "DGC local gradient clipping, max norm per tensor"),
}
SPECS: dict[str, tuple[Callable[..., CompressorBase], _P, bool]] = {
    "none": (lambda: NoCompression(), {}, False),
    "fp16": (lambda: Cast(torch.float16), {}, False),
    "bf16": (lambda: Cast(torch.bfloat16), {}, False),
    "int8": (lambda seed: SharedScaleQuant(8, seed), {"seed": (int, 0, "rounding RNG seed")}, False),
    "int4": (lambda seed: SharedScaleQuant(4, seed), {"seed": (int, 0, "rounding RNG seed")}, False),
    "qsgd": (lambda levels, seed: QSGD(levels, seed), {"levels": (int, 16, "levels per sign, 1..127"), "seed": (int, 0, "rounding RNG seed")}, False),
    "randomk": (lambda ratio, seed: RandomK(ratio, seed), {"ratio": (float, 0.01, "fraction sent"), "seed": (int, 0, "index RNG seed")}, False),
    "topk": (
        lambda ratio, warmup, stage_steps, sample: TopK(ratio, bool(warmup), steps_per_stage=stage_steps, sample=sample),
        {
            "ratio": (float, 0.001, "fraction sent after warm-up"),
            "warmup": (int, 1, "1/0: DGC sparsity warm-up 75%..99.9%"),
            "stage_steps": (int, 100, "steps per warm-up stage"),
            "sample": (float, 0.0, "fraction sampled to estimate the threshold, exact top-k of the candidates (DGC); 0 = plain topk"),
        },
        True,
    ),
    "powersgd": (
        lambda rank, seed, start, min_rate, bits, dense_bits: PowerSGD(rank, seed, start, min_rate, bits, dense_bits),
        {
            "rank": (int, 4, "approximation rank"),
            "seed": (int, 0, "Q init seed, same on all ranks"),
            "start": (int, 0, "uncompressed steps first (torch's start_powerSGD_iter)"),
            "min_rate": (float, 1.0, "send a matrix uncompressed unless n*m >= min_rate*(n+m)*rank"),
            "bits": (int, 32, "factor precision on the wire: 32 fp32, 16 bf16, 8 int8 (shared scales from the last step)"),
            "dense_bits": (int, 32, "precision of tensors sent uncompressed (biases, norms): 32 as given, 16 bf16"),
        },
        True,
    ),
    "sign": (lambda: MajorityVote(), {}, True),
}


def describe_specs() -> str:
    lines = []
    for name, (_, params, ef_default) in SPECS.items():
        allp = {**params, **_EF, **(_DGC if name == "topk" else {})}
        ps = ", ".join(f"{k}={d if k != 'ef' else int(ef_default)} ({h})" for k, (_, d, h) in allp.items())
        lines.append(f"  {name}: {ps}")
    return "valid compressor specs (name:key=value,...):\n" + "\n".join(lines)


def _convert(name: str, key: str, typ: type, raw: str):
    try:
        return typ(raw) if typ is not int else int(raw, 10)
    except ValueError:
        raise ValueError(f"compressor {name!r}: {key}={raw!r} is not a valid {typ.__name__}\n{describe_specs()}") from None


def parse_compressor(spec: str) -> CompressorBase:
    if not isinstance(spec, str):
        raise TypeError(f"compressor spec must be a str such as 'powersgd:rank=4', got {type(spec).__name__}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in SPECS:
        raise ValueError(f"unknown compressor {name!r}\n{describe_specs()}")
    builder, params, ef_default = SPECS[name]
    allowed = {**params, **_EF, **(_DGC if name == "topk" else {})}
    values = {k: d for k, (_, d, _) in allowed.items()}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or key not in allowed:
            raise ValueError(f"compressor {name!r} has no parameter {item!r}\n{describe_specs()}")
        values[key] = _convert(name, key, allowed[key][0], raw.strip())
    ef_raw = values.pop("ef")
    if ef_raw not in (None, 0, 1):
        raise ValueError(f"compressor {name!r}: ef must be 0 or 1, got {ef_raw}\n{describe_specs()}")
    ef = ef_default if ef_raw is None else bool(ef_raw)
    momentum, clip = values.pop("momentum", 0.0), values.pop("clip", None)
    try:
        compressor = builder(**values)
        if ef:
            return ErrorFeedback(compressor, momentum=momentum, clip_norm=clip)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"compressor spec {spec!r}: {exc}\n{describe_specs()}") from None
    if momentum or clip is not None:
        raise ValueError(f"compressor spec {spec!r}: momentum/clip act on the error-feedback residual; they need ef=1")
    return compressor
