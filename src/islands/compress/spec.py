"""Compressor specs as text ("powersgd:rank=4", "topk:ratio=0.001,warmup=false", "sign:ef=false") -> objects.

The grammar is islands.spec's; the names and their parameters are COMPRESSORS (islands.compress.registry), read
from the constructors. Error feedback is on by default for the biased compressors (topk, sign, powersgd), off
for the unbiased or near-exact ones (randomk, qsgd, int8, int4, fp16, bf16), and switchable with ef=true/false
(or 1/0) for any of them (SOTA-214). topk also takes DGC's momentum and clip, which need error feedback.
"""

from __future__ import annotations

from islands.compress.base import CompressorBase
from islands.compress.error_feedback import with_error_feedback
from islands.compress.registry import COMPRESSORS
from islands.spec import Spec, SpecError

SPECS = COMPRESSORS  # the older name: `name in SPECS`, `for name in SPECS`


def describe_specs() -> str:
    return COMPRESSORS.describe()


def build_compressor(spec: str | Spec, **context) -> CompressorBase:
    """The compressor a spec names, unwrapped, with its error-feedback wish (`ef`) set: what the strategies take
    (they wrap it in ErrorFeedback themselves, islands.compress.error_feedback.with_error_feedback). `context`:
    values for parameters the spec does not give (the job's seed for torch-powersgd, say)."""
    try:
        compressor = COMPRESSORS.build(spec, **context)
        with_error_feedback(compressor)  # refuses a non-contractive compressor with ef now, at the edge
    except ValueError as e:
        what = str(e) if isinstance(e, SpecError) else f"compressor {spec}: {e}"
        listing = "" if "valid compressor specs" in what else f"\n{describe_specs()}"
        raise SpecError(f"{what}{listing}") from None
    return compressor


def parse_compressor(spec: str | Spec) -> CompressorBase:
    """The compressor a spec names, ready to use (wrapped in ErrorFeedback where `ef` asks for it)."""
    return with_error_feedback(build_compressor(spec))
