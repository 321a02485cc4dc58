"""Block-scaled 4-bit quantiser for outer deltas (Streaming DiLoCo sends 4-bit deltas, LIT-214).

Each block of `block` values shares one fp32 scale s = max |x| over the block. A value becomes the
integer q = round(7 x / s) in [-7, 7], stored as q + 8 in a nibble, two nibbles per byte.

Round-trip bound (stated and tested): |x - decode(encode(x))| <= s / 14 for every value, where s is
its block's max |x| (half of one quantisation step s / 7), plus fp32 rounding of at most a few ulp(s).
A block of zeros decodes to zeros exactly. Rounding is deterministic (to nearest), so every rank
decodes the same bits from the same payload.

Payload bytes for n values: ceil(n / 2) codes + 4 * ceil(n / block) scale bytes.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

LEVELS = 7  # 15 of the 16 nibble codes: symmetric, so zero is exact and the sign costs nothing extra


class PayloadCodec(ABC):
    """A compressor of the exchange's payload codec kind (Exchange(compressor=...)): encode each island's vector into
    uint8 bytes, all-gather them, decode all and average in rank order on every rank. Quant4 and Quant4Zstd are
    the two; `variable_length` payloads (Quant4Zstd) are gathered with their lengths first. The parameter server's
    pushes take them too, and ps_codecs.CompressedPushes, an islands.compress compressor as one."""

    name = "codec"
    variable_length = False

    @abstractmethod
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """This island's vector as uint8 payload bytes."""

    @abstractmethod
    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """The `numel` values one payload encodes."""

    def encode_part(self, x: torch.Tensor, part: int) -> torch.Tensor:
        """Range `part` of a vector the parameter server's processes split into ranges, one per server (ps_remote):
        a stateless codec encodes each range alike; one with state (ps_codecs.CompressedPushes) keeps it per range."""
        return self.encode(x)


class Quant4(PayloadCodec):
    name = "quant4"

    def __init__(self, block: int = 1024):
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.block = int(block)

    def payload_nbytes(self, numel: int) -> int:
        return math.ceil(numel / 2) + 4 * math.ceil(numel / self.block)

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        """The per-value round-trip bound s / 14 for each value of x (fp32, x's shape)."""
        scales = self._scales(x.detach().to(torch.float32).reshape(-1))
        per_value = scales.repeat_interleave(self.block)[: x.numel()]
        return (per_value / (2 * LEVELS)).reshape(x.shape)

    def _scales(self, flat: torch.Tensor) -> torch.Tensor:
        pad = (-flat.numel()) % self.block
        blocks = torch.nn.functional.pad(flat, (0, pad)).reshape(-1, self.block)
        return blocks.abs().amax(dim=1)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """One uint8 tensor: packed codes then the fp32 scales' bytes."""
        flat = x.detach().to(torch.float32).reshape(-1)
        if not bool(torch.isfinite(flat).all()):
            raise ValueError("quant4: refusing to encode NaN/Inf (a diverged island would poison the average)")
        n = flat.numel()
        scales = self._scales(flat)
        per_value = scales.repeat_interleave(self.block)[:n]
        safe = torch.where(per_value > 0, per_value, torch.ones_like(per_value))
        q = torch.round(flat / safe * LEVELS).clamp_(-LEVELS, LEVELS).to(torch.int16)
        codes = (q + 8).to(torch.uint8)
        if n % 2:
            codes = torch.cat([codes, torch.full((1,), 8, dtype=torch.uint8)])
        packed = codes[0::2] | (codes[1::2] << 4)
        return torch.cat([packed, scales.contiguous().view(torch.uint8)])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        n_codes = math.ceil(numel / 2)
        n_blocks = math.ceil(numel / self.block)
        if payload.dtype != torch.uint8 or payload.numel() != n_codes + 4 * n_blocks:
            raise ValueError(
                f"quant4: payload of {payload.numel()} {payload.dtype} does not hold {numel} values "
                f"(expected {n_codes + 4 * n_blocks} uint8)"
            )
        packed = payload[:n_codes]
        scales = payload[n_codes:].clone().view(torch.float32)  # clone: the view needs an aligned start
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:numel]
        q = codes.to(torch.float32) - 8
        per_value = scales.repeat_interleave(self.block)[:numel]
        return q * per_value / LEVELS
