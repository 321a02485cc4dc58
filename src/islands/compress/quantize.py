"""Unbiased stochastic quantisation: QSGD (gathered, per-rank norm) and shared-scale int8/int4 (summable).

Both round stochastically: a value v * levels lying between integers l and l+1 becomes l+1 with
probability (v * levels - l), so the expected code is exact and the decoded tensor is unbiased.
Randomness comes from the compressor's own generator, never the global RNG.
"""

from __future__ import annotations

import torch
from torch import Tensor

from islands.compress.base import (
    Agreed,
    Combine,
    CompressorBase,
    Payload,
    SeededMixin,
    as_fp32,
    cpu_kernels,
    numel_of,
)
from islands.compress.bits import pack_nibbles, unpack_nibbles


def _stochastic_round(x: Tensor, gen: torch.Generator) -> Tensor:
    low = torch.floor(x)
    u = torch.rand(x.shape, generator=gen, device=x.device, dtype=torch.float32)
    return low + (u < (x - low)).to(x.dtype)


class QSGD(SeededMixin, CompressorBase):
    """QSGD (Alistarh et al.): codes sign(x) * round_stochastic(|x| / ||x||_2 * levels), per rank.

    Codes travel as int8, or packed two per byte when levels <= 7 (they then fit a signed nibble).
    Payload: codes + one fp32 norm. Gathered: each rank's norm differs, so codes cannot be summed.
    """

    name = "qsgd"
    combine = Combine.GATHERED
    contractive = False  # unbiased: error variance up to min(n/s^2, sqrt(n)/s) x ||x||^2, above 1 for big tensors

    def __init__(self, levels: int = 16, seed: int = 0, ef: bool = False):
        """Stochastic quantisation to `levels` per sign (1..127); `seed`: rounding RNG seed. `ef`: error feedback
        around it."""
        super().__init__()
        self.ef = bool(ef)
        if not isinstance(levels, int) or not 1 <= levels <= 127:
            raise ValueError(f"qsgd levels must be an int in [1, 127] (int8 codes), got {levels!r}")
        self.levels = levels
        self._init_rng(seed)

    @property
    def packed(self) -> bool:
        return self.levels <= 7

    def compress(self, tensor: Tensor, state: dict, agreed: Agreed | None = None) -> Payload:
        x = as_fp32(tensor).reshape(-1)
        norm = x.norm() if x.numel() else torch.zeros((), device=x.device)
        if float(norm) == 0.0:
            codes = torch.zeros_like(x, dtype=torch.int8)
        else:
            mag = _stochastic_round(x.abs() / norm * self.levels, self.generator(x.device))
            codes = (torch.sign(x) * mag).to(torch.int8)
        wire = pack_nibbles((codes + 8).to(torch.uint8)) if self.packed else codes
        return Payload([wire, norm.reshape(1).to(torch.float32)], tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload) -> Tensor:
        wire, norm = payload.tensors
        n = numel_of(payload.shape)
        codes = unpack_nibbles(wire, n) - 8 if self.packed else wire
        out = codes.to(torch.float32) * (norm / self.levels)
        return out.reshape(payload.shape).to(payload.dtype)

    def payload_nbytes(self, shape, dtype) -> int:
        n = numel_of(shape)
        return ((n + 1) // 2 if self.packed else n) + 4

    def state_dict(self) -> dict:
        return {**super().state_dict(), "rng": self.rng_state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.load_rng_state_dict(state_dict["rng"])


class SharedScaleQuant(SeededMixin, CompressorBase):
    """int8 / int4 codes against one scale every rank agrees on (the max |x| over ranks), summable.

    The codes of all ranks are summed in their own narrow integer type, so each rank may only use
    levels that leave room for the sum: int8 uses 127 // ranks levels per sign; int4 stores
    code + levels as an unsigned nibble and uses 15 // (2 * ranks) levels (so at most 7 ranks).
    Payload: the codes (n or ceil(n/2) bytes) after a 4-byte agreement round for the scale.
    """

    combine = Combine.SUMMABLE
    agree_op = "max"

    def __init__(self, bits: int = 8, seed: int = 0, ef: bool = False):
        """`bits` (8 or 4) per value with one scale shared by every rank; `seed`: rounding RNG seed. `ef`: error
        feedback around it."""
        super().__init__()
        self.ef = bool(ef)
        if bits not in (8, 4):
            raise ValueError(f"shared-scale quantisation supports bits=8 or bits=4, got {bits!r}")
        self.bits = bits
        self.name = f"int{bits}"
        self._init_rng(seed)

    def levels(self, parties: int) -> int:
        s = 127 // parties if self.bits == 8 else 15 // (2 * parties)
        if s < 1:
            raise ValueError(
                f"int{self.bits} with a shared scale cannot sum {parties} ranks without overflow; "
                "use qsgd (gathered) or fewer ranks"
            )
        return s

    def agree(self, tensor: Tensor, state: dict) -> list[Tensor]:
        x = as_fp32(tensor).reshape(-1)
        if not x.numel():
            return [torch.zeros(1, device=x.device)]
        lo, hi = torch.aminmax(x)  # max |x| in one pass, no |x| tensor: max(|min|, |max|) is the same value
        return [torch.maximum(lo.abs(), hi.abs()).reshape(1)]

    def compress(self, tensor: Tensor, state: dict, agreed: Agreed | None = None) -> Payload:
        if agreed is None:
            agreed = Agreed(self.agree(tensor, state), 1)
        s = self.levels(agreed.parties)
        scale = agreed.tensors[0].reshape(1).to(torch.float32)
        x = as_fp32(tensor).reshape(-1)
        wire = self._pack(torch.zeros_like(x), s) if float(scale) == 0.0 else self._wire(x, scale, s)
        return Payload([wire], tensor.shape, tensor.dtype, shared=[scale], meta={"levels": s}, agreed_nbytes=4)

    def _wire(self, x: Tensor, scale: Tensor, s: int) -> Tensor:
        """The codes on the wire: stochastically rounded x / scale * s, clamped to [-s, s] (another rank's max may
        equal ours only up to rounding; codes must stay in range), as int8 or as nibbles of code + s. The uniforms
        come from torch.rand on this compressor's generator either way; on the CPU one compiled pass does the rest
        with the same fp32 operations (kernels.shared_scale_wire)."""
        gen = self.generator(x.device)
        kernels = cpu_kernels(x)
        if kernels is None:
            return self._pack(_stochastic_round((x / scale * s).clamp(-s, s), gen), s)
        u = torch.rand(x.shape, generator=gen, device=x.device, dtype=torch.float32)
        n = x.numel()
        wire = torch.empty(n, dtype=torch.int8) if self.bits == 8 else torch.empty((n + 1) // 2, dtype=torch.uint8)
        if kernels.shared_scale_wire(x.numpy(), float(scale), s, u.numpy(), self.bits == 4, wire.numpy()):
            return wire
        y = (x / scale * s).clamp(-s, s)  # a NaN: torch's ops on the same uniforms
        low = torch.floor(y)
        return self._pack(low + (u < (y - low)).to(y.dtype), s)

    def _pack(self, codes: Tensor, s: int) -> Tensor:
        return codes.to(torch.int8) if self.bits == 8 else pack_nibbles((codes + s).to(torch.uint8))

    def decompress(self, payload: Payload) -> Tensor:
        s = payload.meta["levels"]
        (wire,) = payload.tensors
        n = numel_of(payload.shape)
        if self.bits == 8:  # int8 * fp32 promotes each code to fp32, then multiplies: one pass, same values
            out = torch.mul(wire, payload.shared[0] / s)
        else:
            factor = payload.shared[0] / s
            kernels = cpu_kernels(wire)
            if kernels is not None and factor.device.type == "cpu":
                out = torch.empty(n, dtype=torch.float32)
                kernels.nibbles_decode(wire.numpy(), s * payload.summands, factor.numpy()[0], out.numpy())
            else:
                out = (unpack_nibbles(wire, n) - s * payload.summands).to(torch.float32) * factor
        return out.reshape(payload.shape).to(payload.dtype)

    def payload_nbytes(self, shape, dtype) -> int:
        n = numel_of(shape)
        return (n if self.bits == 8 else (n + 1) // 2) + 4

    def state_dict(self) -> dict:
        return {**super().state_dict(), "rng": self.rng_state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.load_rng_state_dict(state_dict["rng"])
