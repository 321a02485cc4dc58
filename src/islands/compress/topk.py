"""Top-k sparsification with Deep Gradient Compression's sparsity warm-up (LIT-056, SOTA-224).

TopK itself only selects: the k largest |x| travel as (values, indices). DGC's other corrections
(momentum correction, momentum factor masking, local gradient clipping) live in ErrorFeedback, which
owns the accumulated residual they act on; `deep_gradient_compression()` composes the two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from islands.compress.base import (
    Agreed,
    Combine,
    CompressorBase,
    Payload,
    as_fp32,
    index_dtype,
    name_seed,
    nbytes_of,
    numel_of,
)
from islands.compress.sparse import SparsePayload

# LIT-056 / SOTA-224: sparsity ramps 75%, 93.75%, 98.4375%, 99.6%, 99.9% (density 4x lower per stage).
DGC_SPARSITY_WARMUP: tuple[float, ...] = (0.75, 0.9375, 0.984375, 0.996, 0.999)


# Candidates aimed at: twice k, so a threshold estimated from a small sample still admits all of
# the top k with high probability (DGC, LIT-056, samples 0.1%-1% of the entries).
SAMPLE_MARGIN = 2.0
MIN_SAMPLE = 64
# Below this many entries a full torch.topk costs less than drawing the sample (measured on CPU: ~0.05 ms
# for 16 K entries against ~0.15 ms of sampling overhead), so small tensors skip the estimate.
MIN_SAMPLED_NUMEL = 1 << 16


def sampled_topk_indices(mag: Tensor, k: int, sample: float, seed: int) -> Tensor:
    """The indices torch.topk(mag, k) would pick (up to ties), found DGC's way (LIT-056): estimate the
    k-th largest magnitude from a random sample, keep entries at or above it, and run the exact top-k
    on those few candidates only. Exact, not approximate: when fewer than k entries pass the estimated
    threshold, it falls back to torch.topk on the whole tensor. The sample comes from a generator
    seeded by (step, name), so it is reproducible and leaves the global RNG alone."""
    n = mag.numel()
    s = min(n, max(MIN_SAMPLE, math.ceil(sample * n)))
    g = torch.Generator(device=mag.device).manual_seed(seed)
    probe = mag[torch.randint(0, n, (s,), generator=g, device=mag.device)]
    ks = min(s, max(1, math.ceil(SAMPLE_MARGIN * k * s / n)))
    threshold = torch.topk(probe, ks, sorted=False).values.min()
    candidates = torch.nonzero(mag >= threshold).reshape(-1)
    if candidates.numel() < k:
        return torch.topk(mag, k, sorted=False).indices
    return candidates[torch.topk(mag[candidates], k, sorted=False).indices]


class TopK(SparsePayload, CompressorBase):
    name = "topk"
    combine = Combine.GATHERED

    def __init__(
        self,
        ratio: float = 0.001,
        warmup: bool = False,
        schedule: Sequence[float] = DGC_SPARSITY_WARMUP,
        steps_per_stage: int = 100,
        sample: float = 0.0,
        ef: bool = True,
        momentum: float = 0.0,
        clip: float | None = None,
    ):
        """Top `ratio` of each tensor by magnitude (LIT-056). `warmup`: DGC's sparsity warm-up (75%..99.9%,
        `steps_per_stage` steps each). `sample`: fraction sampled to estimate the threshold, then exact top-k of
        the candidates (DGC); 0 = plain top-k. `ef`: error feedback around it (SOTA-214); `momentum` and `clip`
        are DGC's momentum correction and local clipping, acting on the residual (they need ef)."""
        super().__init__()
        if (momentum or clip is not None) and not ef:
            raise ValueError("topk momentum/clip act on the error-feedback residual; they need ef=True")
        self.ef, self.ef_momentum, self.ef_clip = bool(ef), float(momentum), clip
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"topk ratio (fraction of entries sent) must be in (0, 1], got {ratio!r}")
        if any(not 0.0 <= s < 1.0 for s in schedule) or list(schedule) != sorted(schedule):
            raise ValueError(f"topk warm-up schedule must be ascending sparsities in [0, 1), got {list(schedule)}")
        if steps_per_stage < 1:
            raise ValueError(f"topk steps_per_stage must be >= 1, got {steps_per_stage!r}")
        self.ratio = float(ratio)
        self.warmup = bool(warmup)
        self.schedule = tuple(float(s) for s in schedule)
        self.steps_per_stage = int(steps_per_stage)
        if not 0.0 <= sample <= 1.0:
            raise ValueError(
                f"topk sample (fraction of entries sampled to estimate the threshold; 0 = exact topk) "
                f"must be in [0, 1], got {sample!r}"
            )
        self.sample = float(sample)

    def density(self, step: int | None = None) -> float:
        """Fraction of entries sent at this compress call (None: after warm-up)."""
        if not self.warmup or step is None or step >= len(self.schedule) * self.steps_per_stage:
            return self.ratio
        # Never sparser than the target: a 1% target stops the ramp at 99%.
        return max(self.ratio, 1.0 - self.schedule[step // self.steps_per_stage])

    def k(self, numel: int, step: int | None = None) -> int:
        if numel == 0:
            return 0
        # the 1e-9 keeps an exact product such as 0.25 * 8 from rounding up to 3
        return max(1, min(numel, math.ceil(self.density(step) * numel - 1e-9)))

    def init_state(self, name: str, tensor: Tensor) -> dict:
        return {"step": 0}

    def compress(self, tensor: Tensor, state: dict, agreed: Agreed | None = None) -> Payload:
        flat = tensor.detach().reshape(-1)
        k = self.k(flat.numel(), state["step"])
        if not k:
            idx = flat.new_zeros(0, dtype=torch.long)
        elif self.sample and k < flat.numel() and flat.numel() >= MIN_SAMPLED_NUMEL:
            idx = sampled_topk_indices(
                as_fp32(flat).abs(), k, self.sample, name_seed(state["step"], state.get("_name", ""))
            )
        else:
            idx = torch.topk(as_fp32(flat).abs(), k, sorted=False).indices
        state["step"] += 1
        values = flat[idx].contiguous()  # copied in the input dtype: exact, no rounding
        return Payload([values, idx.to(index_dtype(flat.numel()))], tensor.shape, tensor.dtype)

    def payload_nbytes(self, shape, dtype, step: int | None = None) -> int:
        n = numel_of(shape)
        k = self.k(n, step)
        return nbytes_of(k, dtype) + nbytes_of(k, index_dtype(n))
