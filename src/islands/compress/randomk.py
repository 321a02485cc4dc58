"""Random-k sparsification, rescaled by n/k so the decoded tensor is an unbiased estimate.

Indices come from the compressor's own torch.Generator (seed it differently per rank for independent
draws); the global RNG is never touched, so data order and dropout stay reproducible.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from islands.compress.base import (
    Agreed,
    Combine,
    CompressorBase,
    Payload,
    SeededMixin,
    as_fp32,
    index_dtype,
    nbytes_of,
    numel_of,
)
from islands.compress.sparse import SparsePayload


class RandomK(SparsePayload, SeededMixin, CompressorBase):
    name = "randomk"
    combine = Combine.GATHERED
    contractive = False  # the n/k rescaling: |decoded| is n/k times the input on the kept entries

    def __init__(self, ratio: float = 0.01, seed: int = 0, ef: bool = False):
        """Random `ratio` of the entries, rescaled by n/k to stay unbiased; `seed`: index RNG seed. `ef`: error
        feedback around it."""
        super().__init__()
        self.ef = bool(ef)
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"randomk ratio (fraction of entries sent) must be in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)
        self._init_rng(seed)

    def k(self, numel: int) -> int:
        return 0 if numel == 0 else max(1, min(numel, math.ceil(self.ratio * numel - 1e-9)))

    def compress(self, tensor: Tensor, state: dict, agreed: Agreed | None = None) -> Payload:
        x = as_fp32(tensor).reshape(-1)
        n = x.numel()
        k = self.k(n)
        idx = torch.randperm(n, generator=self.generator(x.device), device=x.device)[:k]
        values = (x[idx] * (n / k if k else 1.0)).to(tensor.dtype)
        return Payload([values, idx.to(index_dtype(n))], tensor.shape, tensor.dtype)

    def payload_nbytes(self, shape, dtype) -> int:
        n = numel_of(shape)
        return nbytes_of(self.k(n), dtype) + nbytes_of(self.k(n), index_dtype(n))

    def state_dict(self) -> dict:
        return {**super().state_dict(), "rng": self.rng_state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.load_rng_state_dict(state_dict["rng"])
