"""1-bit compression: signs packed 8 per byte plus one fp32 scale (mean |x|).

ScaledSign averages the decoded ranks (the 1-bit Adam form, LIT-278). MajorityVote is signSGD with
majority vote (LIT-280): the combined result is the per-coordinate vote, itself a 1-bit payload
(`vote`), so nothing wider than a bit per coordinate travels in either direction. With an
all-gather every rank computes the vote from the packed signs; a parameter server would send the
vote payload back.
"""

from __future__ import annotations

import torch
from torch import Tensor

from islands.compress.base import Agreed, Combine, CompressorBase, Payload, as_fp32, numel_of
from islands.compress.bits import pack_bits, unpack_bits


class ScaledSign(CompressorBase):
    name = "scaled_sign"
    combine = Combine.GATHERED

    def __init__(self, ef: bool = True):
        """1 bit per coordinate and one fp32 scale (the mean |x|); `ef`: error feedback around it (SOTA-214)."""
        super().__init__()
        self.ef = bool(ef)

    def compress(self, tensor: Tensor, state: dict, agreed: Agreed | None = None) -> Payload:
        x = as_fp32(tensor).reshape(-1)
        scale = x.abs().mean().reshape(1) if x.numel() else torch.zeros(1, device=x.device)
        return Payload([pack_bits(x >= 0), scale], tensor.shape, tensor.dtype)

    def signs(self, payload: Payload) -> Tensor:
        """+1 / -1 per coordinate (zero counts as +1), fp32."""
        bits = unpack_bits(payload.tensors[0], numel_of(payload.shape))
        return bits.to(torch.float32) * 2 - 1

    def decompress(self, payload: Payload) -> Tensor:
        out = self.signs(payload) * payload.tensors[1]
        return out.reshape(payload.shape).to(payload.dtype)

    def payload_nbytes(self, shape, dtype) -> int:
        return (numel_of(shape) + 7) // 8 + 4


class MajorityVote(ScaledSign):
    name = "sign"

    def vote(self, payloads: list[Payload]) -> Payload:
        """Per-coordinate majority of the ranks' signs, as a 1-bit payload scaled by the mean scale.

        Ties (possible with an even number of ranks) go to the sign of the scale-weighted sum, then
        to +1, so the vote needs one bit and every rank computes the same one.
        """
        first = payloads[0]
        signs = torch.stack([self.signs(p) for p in payloads])
        scales = torch.stack([p.tensors[1].reshape(()) for p in payloads])
        count = signs.sum(dim=0)
        weighted = (signs * scales.reshape(-1, 1)).sum(dim=0)
        positive = torch.where(count != 0, count > 0, weighted >= 0)
        return Payload([pack_bits(positive), scales.mean().reshape(1)], first.shape, first.dtype)

    def combine_gathered(self, payloads: list[Payload]) -> Tensor:
        return self.decompress(self.vote(payloads))
