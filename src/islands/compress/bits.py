"""Bit packing: 8 signs per byte (LIT-280 counts one bit per coordinate) and two nibbles per byte."""

from __future__ import annotations

import torch
from torch import Tensor

from islands.compress.base import cpu_kernels


def _weights(device) -> Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def pack_bits(bits: Tensor) -> Tensor:
    """Flat bool tensor of n entries -> uint8 tensor of ceil(n/8) bytes, little-endian within a byte."""
    n = bits.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=bits.device)
    padded[:n] = bits.reshape(-1).to(torch.uint8)
    return (padded.view(-1, 8) * _weights(bits.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: Tensor, n: int) -> Tensor:
    """Inverse of pack_bits: the first n bits as a bool tensor."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.view(-1, 1) >> shifts) & 1
    return bits.reshape(-1)[:n].to(torch.bool)


def pack_nibbles(codes: Tensor) -> Tensor:
    """Flat uint8 codes in [0, 15] -> ceil(n/2) bytes, element 2i in the low nibble."""
    n = codes.numel()
    padded = torch.zeros(n + (n % 2), dtype=torch.uint8, device=codes.device)
    padded[:n] = codes.reshape(-1)
    pairs = padded.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_nibbles(packed: Tensor, n: int) -> Tensor:
    """Inverse of pack_nibbles, widened to int16 so sums of several ranks' nibbles stay exact."""
    low = (packed & 15).to(torch.int16)
    high = (packed >> 4).to(torch.int16)
    return torch.stack([low, high], dim=1).reshape(-1)[:n]


def _spans(width: int) -> int:
    """Bytes one `width`-bit field can touch when it starts at any bit of a byte."""
    return (width + 7 + 7) // 8


def pack_uint(values: Tensor, width: int) -> Tensor:
    """Flat non-negative integers below 2**width -> ceil(n * width / 8) bytes: each value's `width` bits,
    least significant first, one after another across byte boundaries (indices of 12 bits, 2-bit codes).

    Whole-buffer integer ops: value i starts at bit i * width, so it is shifted by its bit offset within its
    first byte and its (at most 5) bytes are added into place; fields never overlap, so the adds are ORs."""
    if not 1 <= width <= 32:
        raise ValueError(f"pack_uint width must be in [1, 32], got {width}")
    v = values.reshape(-1).to(torch.int64)
    if width == 8:
        return v.to(torch.uint8)
    n = v.numel()
    nbytes = packed_nbytes(n, width)
    kernels = cpu_kernels(v)
    if kernels is not None:  # one compiled pass, the same bytes
        out = torch.empty(nbytes, dtype=torch.uint8)
        kernels.pack_fields(v.contiguous().numpy(), width, out.numpy())
        return out
    if 8 % width == 0:  # whole fields per byte: one multiply-add over (bytes, fields per byte)
        per = 8 // width
        padded = torch.zeros(nbytes * per, dtype=torch.int64, device=v.device)
        padded[:n] = v
        shifts = torch.arange(0, 8, width, dtype=torch.int64, device=v.device)
        return (padded.view(-1, per) << shifts).sum(dim=1).to(torch.uint8)
    offset = torch.arange(n, dtype=torch.int64, device=v.device) * width
    first, piece = offset >> 3, v << (offset & 7)
    out = torch.zeros(nbytes + _spans(width), dtype=torch.int64, device=v.device)
    for j in range(_spans(width)):
        out.index_add_(0, first + j, (piece >> (8 * j)) & 0xFF)
    return out[:nbytes].to(torch.uint8)


def unpack_uint(packed: Tensor, width: int, n: int) -> Tensor:
    """Inverse of pack_uint: the first n values, as int64."""
    flat = packed.reshape(-1)
    if width == 8:
        return flat[:n].to(torch.int64)
    if 8 % width == 0:
        shifts = torch.arange(0, 8, width, dtype=torch.int64, device=flat.device)
        return ((flat.to(torch.int64).view(-1, 1) >> shifts) & ((1 << width) - 1)).reshape(-1)[:n]
    spans = _spans(width)
    wide = torch.zeros(flat.numel() + spans, dtype=torch.int64, device=flat.device)
    wide[: flat.numel()] = flat
    offset = torch.arange(n, dtype=torch.int64, device=flat.device) * width
    first = offset >> 3
    word = wide[first]
    for j in range(1, spans):
        word |= wide[first + j] << (8 * j)
    return (word >> (offset & 7)) & ((1 << width) - 1)


def packed_nbytes(n: int, width: int) -> int:
    """Bytes pack_uint makes of n values of `width` bits."""
    return (int(n) * int(width) + 7) // 8
