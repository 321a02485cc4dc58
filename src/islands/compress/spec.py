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


def parse_compressor(spec: str | Spec, **context) -> CompressorBase:
    """The compressor a spec names, ready to use on its own (wrapped in ErrorFeedback where its `ef` asks for it;
    the strategies take COMPRESSORS.build(spec) and wrap it themselves). `context`: values for parameters the
    spec does not give. A non-contractive compressor with ef=true is refused here, at the edge."""
    try:
        return with_error_feedback(COMPRESSORS.build(spec, **context))
    except ValueError as e:
        what = str(e) if isinstance(e, SpecError) else f"compressor {spec}: {e}"
        listing = "" if "valid compressor specs" in what else f"\n{COMPRESSORS.describe()}"
        raise SpecError(f"{what}{listing}") from None
