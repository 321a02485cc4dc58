"""What top-k and random-k share: a (values, indices) payload, scattered back and averaged."""

from __future__ import annotations

import torch
from torch import Tensor

from islands.compress import pages
from islands.compress.base import Payload, numel_of


class SparsePayload:
    """Mixin for compressors whose payload is [values, flat indices] of a tensor's shape and dtype."""

    def decompress(self, payload: Payload) -> Tensor:
        values, idx = payload.tensors
        out = pages.zeros(numel_of(payload.shape), dtype=payload.dtype, device=values.device)
        out[idx.long()] = values.to(payload.dtype)
        return out.reshape(payload.shape)

    def combine_gathered(self, payloads: list[Payload]) -> Tensor:
        first = payloads[0]
        acc = pages.zeros(numel_of(first.shape), device=first.tensors[0].device)
        for p in payloads:  # rank order: identical sums on every rank
            values, idx = p.tensors
            acc.index_add_(0, idx.long(), values.to(torch.float32))
        return (acc / len(payloads)).reshape(first.shape).to(first.dtype)
