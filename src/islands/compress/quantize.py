"""Unbiased stochastic quantisation: QSGD (gathered, per-rank norm) and shared-scale int8/int4 (summable).

Both round stochastically: a value v * levels lying between integers l and l+1 becomes l+1 with
probability (v * levels - l), so the expected code is exact and the decoded tensor is unbiased.
Randomness comes from the compressor's own generator, never the global RNG.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from islands.compress import pages
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


def _quant_kernels(tensor: Tensor, draws: bool = False) -> Any:
    """islands.compress.kernels_quant where the compiled CPU loops run for `tensor` (base.cpu_kernels), else None;
    for a caller that `draws` uniforms, also None where its replay of torch's CPU generator does not match this
    torch's (checked once per process)."""
    kernels_quant = cpu_kernels(tensor, "kernels_quant")
    return kernels_quant if kernels_quant is None or not draws or kernels_quant.matches_torch() else None


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
        are torch.rand's on this compressor's generator either way: on the CPU one compiled pass draws them from
        the generator's own engine as it rounds (kernels_quant.shared_scale_wire, the same uniforms, fp32 operations
        and generator state after); elsewhere, or where that pass meets a NaN, torch.rand and torch's ops."""
        gen = self.generator(x.device)
        kernels = cpu_kernels(x)
        if kernels is None:
            return self._pack(_stochastic_round((x / scale * s).clamp(-s, s), gen), s)
        n = x.numel()
        nibbles = self.bits == 4
        wire = pages.empty((n + 1) // 2, torch.uint8) if nibbles else pages.empty(n, torch.int8)
        fast = _quant_kernels(x, draws=True)
        state = None if fast is None else fast.engine(gen)
        if state is not None:
            raw, words, pos = state
            ok, pos = fast.shared_scale_wire(x.numpy(), float(scale), s, nibbles, words, pos, wire.numpy())
            if ok:
                fast.store(gen, raw, words, pos)
                return wire
            # a NaN: the generator is as it was, so torch.rand below draws the same uniforms
        u = torch.rand(x.shape, generator=gen, device=x.device, dtype=torch.float32)
        if state is None and kernels.shared_scale_wire(x.numpy(), float(scale), s, u.numpy(), nibbles, wire.numpy()):
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
        factor = payload.shared[0] / s
        fast = _quant_kernels(wire) if factor.device.type == "cpu" else None
        if fast is not None:  # one compiled pass into a vector on 2 MB pages: the same values as the ops below
            out = pages.empty(n)
            if self.bits == 8:
                fast.int8_decode(wire.numpy(), factor.numpy()[0], out.numpy())
            else:
                cpu_kernels(wire).nibbles_decode(wire.numpy(), s * payload.summands, factor.numpy()[0], out.numpy())
        elif self.bits == 8:  # int8 * fp32 promotes each code to fp32, then multiplies: one pass, same values
            out = torch.mul(wire, factor)
        else:
            out = (unpack_nibbles(wire, n) - s * payload.summands).to(torch.float32) * factor
        return out.reshape(payload.shape).to(payload.dtype)

    def subtract_sent(self, x: Tensor, payload: Payload) -> Tensor:
        """x - decompress(payload), in place in x on the CPU (the payload's codes never share x's memory), with
        decompress's fp32 operations; where decompress rounds to a narrower dtype, torch's ops."""
        fast = _quant_kernels(x)
        factor = payload.shared[0] / payload.meta["levels"]
        if fast is None or payload.dtype != torch.float32 or not x.is_contiguous() or factor.device.type != "cpu":
            return super().subtract_sent(x, payload)
        offset = payload.meta["levels"] * payload.summands
        fast.subtract_wire(x.view(-1).numpy(), payload.tensors[0].numpy(), self.bits == 4, offset, factor.numpy()[0])
        return x

    def payload_nbytes(self, shape, dtype) -> int:
        n = numel_of(shape)
        return (n if self.bits == 8 else (n + 1) // 2) + 4

    def state_dict(self) -> dict:
        return {**super().state_dict(), "rng": self.rng_state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.load_rng_state_dict(state_dict["rng"])
