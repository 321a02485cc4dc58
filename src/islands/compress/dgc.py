"""Deep Gradient Compression (LIT-056) as a composition: ErrorFeedback(TopK) with DGC's corrections."""

from __future__ import annotations

from collections.abc import Sequence

from islands.compress.error_feedback import ErrorFeedback
from islands.compress.topk import DGC_SPARSITY_WARMUP, TopK


def deep_gradient_compression(
    ratio: float = 0.001,
    momentum: float = 0.9,
    clip_norm: float | None = None,
    warmup: bool = True,
    schedule: Sequence[float] = DGC_SPARSITY_WARMUP,
    steps_per_stage: int = 100,
) -> ErrorFeedback:
    """Top-k with momentum correction, momentum factor masking, local clipping and sparsity warm-up.

    Momentum lives here, so pair it with an optimizer whose momentum is 0 (plain SGD).
    """
    return ErrorFeedback(TopK(ratio, warmup, schedule, steps_per_stage), momentum=momentum, clip_norm=clip_norm)
