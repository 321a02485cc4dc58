"""fp16 / bf16 casts: 2 bytes per value, summable. fp16 is prescaled by 1/ranks so the sum cannot overflow."""

from __future__ import annotations

import torch
from torch import Tensor

from islands.compress.base import Agreed, Combine, CompressorBase, Payload, as_fp32, nbytes_of, numel_of

_FP16_MAX = 65504.0


class Cast(CompressorBase):
    combine = Combine.SUMMABLE

    def __init__(self, wire_dtype: torch.dtype = torch.bfloat16, ef: bool = False):
        """Each value cast to `wire_dtype` (fp16 or bf16) on the wire; `ef`: error feedback around it."""
        super().__init__()
        self.ef = bool(ef)
        if wire_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"Cast wire_dtype must be torch.float16 or torch.bfloat16, got {wire_dtype}")
        self.wire_dtype = wire_dtype
        self.name = "fp16" if wire_dtype == torch.float16 else "bf16"

    def compress(self, tensor: Tensor, state: dict, agreed: Agreed | None = None) -> Payload:
        parties = agreed.parties if agreed is not None else 1
        x = as_fp32(tensor).reshape(-1)
        if self.wire_dtype == torch.float16:
            # Prescale like torch's fp16 hook: the sum of `parties` values must stay below fp16's max.
            x = x / parties
            if x.numel() and float(x.abs().max()) > _FP16_MAX:
                raise ValueError(
                    f"{state.get('_name', '?')}: |value| {float(x.abs().max()):.3g} overflows fp16 "
                    f"(max {_FP16_MAX}); use bf16 or fp32"
                )
        return Payload(
            [x.to(self.wire_dtype)],
            tensor.shape,
            tensor.dtype,
            meta={"prescale": 1.0 / parties if self.wire_dtype == torch.float16 else 1.0},
        )

    def decompress(self, payload: Payload) -> Tensor:
        out = payload.tensors[0].to(torch.float32) / payload.meta.get("prescale", 1.0)
        return out.reshape(payload.shape).to(payload.dtype)

    def payload_nbytes(self, shape, dtype) -> int:
        return nbytes_of(numel_of(shape), self.wire_dtype)
