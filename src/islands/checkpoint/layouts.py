"""How each float dtype is cut into byte planes, and put back together (SOTA-437, LIT-750).

In trained floats only the exponent (and, weakly, the top mantissa bits) is redundant; sign and low
mantissa bits look random. Each layout isolates the 8-bit exponent as one plane (which planes.py packs
two per byte for the entropy coder) and cuts the remaining bits into byte planes that are Huffman-coded
when a sample of them shrinks and stored otherwise. The bit placement is chosen per dtype for size
*and* for few numpy passes when decoding (measured on trained MiniLM weights, docs/checkpointing.md):

  bf16  s|E|m7:   E (8 bits)        + [s m6..m0]                    join: 6 numpy ops per block
  fp32  s|E|m23:  E (8 bits)        + [s m22..m16] [m15..m8] [m7..m0]   (sign rides with the top
                  mantissa bits, which are noise anyway, so fp16-exact values leave whole zero bytes)
                  When both low bytes are noise (the gate of streams.py, on the samples it would take
                  of each plane) they travel as one stored plane of 16-bit words, [m15..m0]: the join
                  ORs in one word instead of shifting and ORing two bytes (13 -> 10 numpy ops per
                  block; format 5).
  fp16  s|E5|m10: [s E5 m9 m8] + [m7..m0]: the plain high and low bytes. The high byte is one Huffman
                  symbol per element anyway (5-bit exponent), and no bit moves, so the join is two casts,
                  a shift and an OR; it is 0.04% larger than moving the sign out (measured).
  fp64 and other widths: rotate left one bit (sign next to the mantissa), top two bytes entropy-coded.

A layout's `split(raw)` returns (exponent plane or None, [(kind, plane)]) with kind "e" (entropy-code),
"m" (probe, then code or store) or "s" (store: already probed); `plane_sizes(n)` lists the plane
sizes in bytes a chunk of n elements may decode to; `join(exponent, planes, out)` rebuilds the bytes into `out`, where
`exponent` is None, a plain exponent plane, or (packed codes, escaped exponents, base) from planes.py.
Planes are per-thread scratch: valid until the same thread splits again.
"""

from __future__ import annotations

import numpy as np
import torch

from islands.checkpoint.planes import (BLOCK_WORDS, SAMPLE_SIZE, code_scratch, escape_positions, pack_codes, scratch,
                                      window_base, write_exponent_field)
from islands.checkpoint.streams import GATE_MIN_BYTES, is_noise


def _blocks(n: int):
    for b in range(0, n, BLOCK_WORDS):
        yield b, min(n, b + BLOCK_WORDS)


class _ExponentWords:
    """Shared join for layouts whose exponent sits at bits [shift, shift+8) of each word.

    Subclasses set size, word, shift, planes (how many non-exponent planes follow the exponent) and
    define _fill_block(ob, planes, b, e, tmp), which ORs the other planes into output block ob.
    """

    def split(self, raw: np.ndarray):
        """Exponents straight to 4-bit codes (one shift, subtract and cast per block) and the other
        planes from the same block; the plain exponent plane only if too many exponents escape."""
        x = raw.view(self.word)
        n = x.size
        base = window_base(((x[::(n // SAMPLE_SIZE) | 1] >> self.shift) & 0xFF).astype(np.uint8)) if n >= 2 else 0
        codes = code_scratch(n)
        kinds, planes = self._new_planes(x)
        v = scratch(f"split.{self.size}.v", min(n, BLOCK_WORDS), self.word)
        t = scratch(f"split.{self.size}.t", min(n, BLOCK_WORDS), self.word)
        for b, e in _blocks(n):
            xb, vv = x[b:e], v[:e - b]
            np.right_shift(xb, self.shift, out=vv)
            np.subtract(vv, base, out=vv)  # wraps; the low byte is (exponent - base) mod 256
            np.copyto(codes[b:e], vv, casting="unsafe")
            self._split_block(xb, planes, b, e, vv, t[:e - b])
        packed = pack_codes(codes, n) if n >= 2 else None
        if packed is None:
            exp = scratch(f"split.{self.size}.E", n, np.uint8)
            for b, e in _blocks(n):
                np.right_shift(x[b:e], self.shift, out=v[:e - b])
                np.copyto(exp[b:e], v[:e - b], casting="unsafe")  # the cast drops the sign above E
            return exp, list(zip(kinds, planes))
        escaped = ((x[packed[1]] >> self.shift) & 0xFF).astype(np.uint8)
        return (base, packed[0], escaped), list(zip(kinds, planes))

    def _new_planes(self, x: np.ndarray) -> tuple[list[str], list[np.ndarray]]:
        """(kinds, empty planes) that _split_block fills: one probed byte plane per non-exponent byte."""
        return ["m"] * self.planes, [scratch(f"split.{self.size}.{k}", x.size, np.uint8) for k in range(self.planes)]

    def plane_sizes(self, n: int) -> list[list[int]]:
        return [[n] * self.planes]

    def join(self, exponent, planes: list[np.ndarray], out: np.ndarray) -> None:
        o = out.view(self.word)
        n = o.size
        # Each block is built in two cache-resident temporaries and written to `out` by the last OR:
        # one pass over the output instead of one per numpy op (measured 1.2 vs 0.4 ms per op for 16 MB).
        acc = scratch(f"join.{self.size}.acc", min(n, BLOCK_WORDS), self.word)
        tmp = scratch(f"join.{self.size}.tmp", min(n, BLOCK_WORDS), self.word)
        packed = isinstance(exponent, tuple)
        for b, e in _blocks(n):
            a = acc[:e - b]
            if packed:
                write_exponent_field(exponent[0][b // 2:(e + 1) // 2], exponent[2], a, self.shift)
            else:
                np.copyto(a, exponent[b:e], casting="unsafe")
                np.left_shift(a, self.shift, out=a)
            self._fill_block(a, planes, b, e, tmp[:e - b], o[b:e])
        if packed:
            pos = escape_positions(exponent[0], n)
            if pos.size != exponent[1].size:
                raise ValueError(f"{pos.size} escape codes but {exponent[1].size} escaped exponents")
            keep = self.word(~(0xFF << self.shift) & ((1 << (8 * self.size)) - 1))
            o[pos] = (o[pos] & keep) | (exponent[1].astype(self.word) << self.word(self.shift))


class Bf16Layout(_ExponentWords):
    size, word, shift, planes = 2, np.uint16, 7, 1

    def _split_block(self, xb, planes, b, e, v, t):
        np.bitwise_and(xb, 0x807F, out=v)
        np.right_shift(v, 8, out=t)
        np.bitwise_or(v, t, out=v)  # low byte: s << 7 | m
        np.copyto(planes[0][b:e], v, casting="unsafe")

    def _fill_block(self, acc, planes, b, e, tmp, dst):
        np.copyto(tmp, planes[0][b:e], casting="unsafe")
        np.multiply(tmp, 0x0101, out=tmp)  # the byte in both halves: sign lands on bit 15, m on bits 0-6
        np.bitwise_and(tmp, 0x807F, out=tmp)
        np.bitwise_or(acc, tmp, out=dst)


class Fp32Layout(_ExponentWords):
    size, word, shift, planes = 4, np.uint32, 23, 3

    def _new_planes(self, x: np.ndarray) -> tuple[list[str], list[np.ndarray]]:
        """The top byte plane, and the low 16 bits as one stored word plane when the gate would store
        both of their byte planes anyway (it samples the same elements here as it would there)."""
        n = x.size
        if n >= GATE_MIN_BYTES:
            s = x[::(n // SAMPLE_SIZE) | 1]
            if is_noise((s & 0xFF).astype(np.uint8)) and is_noise(((s >> 8) & 0xFF).astype(np.uint8)):
                return ["m", "s"], [scratch("split.4.0", n, np.uint8), scratch("split.4.low", n, np.uint16)]
        return super()._new_planes(x)

    def plane_sizes(self, n: int) -> list[list[int]]:
        return [[n, n, n], [n, 2 * n]]

    def join(self, exponent, planes: list[np.ndarray], out: np.ndarray) -> None:
        if len(planes) == 2:  # the low half as decoded bytes: its words (scratch starts aligned)
            planes = [planes[0], planes[1].view(np.uint16)]
        super().join(exponent, planes, out)

    def _split_block(self, xb, planes, b, e, v, t):
        np.right_shift(xb, 16, out=v)
        np.bitwise_and(v, 0x807F, out=v)
        np.right_shift(v, 8, out=t)
        np.bitwise_or(v, t, out=v)  # low byte: s << 7 | m22..m16
        np.copyto(planes[0][b:e], v, casting="unsafe")
        if len(planes) == 2:  # the low half whole: the cast keeps the low 16 bits
            np.copyto(planes[1][b:e], xb, casting="unsafe")
            return
        np.right_shift(xb, 8, out=v)
        np.copyto(planes[1][b:e], v, casting="unsafe")
        np.copyto(planes[2][b:e], xb, casting="unsafe")

    def _fill_block(self, acc, planes, b, e, tmp, dst):
        np.copyto(tmp, planes[0][b:e], casting="unsafe")
        np.multiply(tmp, 0x01010000, out=tmp)  # wraps: sign to bit 31, m22..m16 to bits 16-22
        np.bitwise_and(tmp, 0x807F0000, out=tmp)
        np.bitwise_or(acc, tmp, out=acc)
        if len(planes) == 2:  # the low half whole
            np.copyto(tmp, planes[1][b:e], casting="unsafe")
            np.bitwise_or(acc, tmp, out=dst)
            return
        np.copyto(tmp, planes[1][b:e], casting="unsafe")
        np.left_shift(tmp, 8, out=tmp)
        np.bitwise_or(acc, tmp, out=acc)
        np.copyto(tmp, planes[2][b:e], casting="unsafe")
        np.bitwise_or(acc, tmp, out=dst)


class Fp16Layout:
    """The high and low bytes as they are: one entropy-coded, one probed (see the module docstring)."""

    size, word, planes = 2, np.uint16, 2

    def plane_sizes(self, n: int) -> list[list[int]]:
        return [[n, n]]

    def split(self, raw: np.ndarray):
        x = raw.view(np.uint16)
        n = x.size
        high, low = scratch("fp16.H", n, np.uint8), scratch("fp16.L", n, np.uint8)
        t = scratch("split.fp16.t", min(n, BLOCK_WORDS), np.uint16)
        for b, e in _blocks(n):
            np.right_shift(x[b:e], 8, out=t[:e - b])  # same-type shift, then a plain cast: no buffered ufunc
            np.copyto(high[b:e], t[:e - b], casting="unsafe")
            np.copyto(low[b:e], x[b:e], casting="unsafe")
        return None, [("e", high), ("m", low)]

    def join(self, exponent, planes, out: np.ndarray) -> None:
        o = out.view(np.uint16)
        acc = scratch("join.fp16.acc", min(o.size, BLOCK_WORDS), np.uint16)
        tmp = scratch("join.fp16.tmp", min(o.size, BLOCK_WORDS), np.uint16)
        for b, e in _blocks(o.size):
            a, t = acc[:e - b], tmp[:e - b]
            np.copyto(a, planes[0][b:e], casting="unsafe")
            np.left_shift(a, 8, out=a)
            np.copyto(t, planes[1][b:e], casting="unsafe")
            np.bitwise_or(a, t, out=o[b:e])  # the only pass that writes the output


class RotatedLayout:
    """Any width: rotate left one bit (exponent on a byte boundary), cut into byte planes, top first."""

    planes_entropy = {8: 2}  # fp64's 11-bit exponent spans the top byte and 3 bits of the next

    def __init__(self, size: int):
        self.size, self.bits, self.planes = size, 8 * size, size
        self.word = {2: np.uint16, 4: np.uint32, 8: np.uint64}[size]

    def plane_sizes(self, n: int) -> list[list[int]]:
        return [[n] * self.planes]

    def split(self, raw: np.ndarray):
        x = raw.view(self.word)
        n = x.size
        out = [scratch(f"rot{self.size}.{j}", n, np.uint8) for j in range(self.size)]
        a = scratch(f"rot{self.size}.a", min(n, BLOCK_WORDS), self.word)
        t = scratch(f"rot{self.size}.t", min(n, BLOCK_WORDS), self.word)
        for b, e in _blocks(n):
            aa, tt = a[:e - b], t[:e - b]
            np.left_shift(x[b:e], 1, out=aa)
            np.right_shift(x[b:e], self.bits - 1, out=tt)
            aa |= tt
            for j in range(self.size):
                np.right_shift(aa, 8 * (self.size - 1 - j), out=tt)
                np.copyto(out[j][b:e], tt, casting="unsafe")
        top = self.planes_entropy.get(self.size, 1)
        return None, [("e" if j < top else "m", p) for j, p in enumerate(out)]

    def join(self, exponent, planes, out: np.ndarray) -> None:
        o = out.view(self.word)
        a = scratch(f"rot{self.size}.a", min(o.size, BLOCK_WORDS), self.word)
        t = scratch(f"rot{self.size}.t", min(o.size, BLOCK_WORDS), self.word)
        for b, e in _blocks(o.size):
            aa, tt = a[:e - b], t[:e - b]
            np.copyto(aa, planes[0][b:e], casting="unsafe")
            for plane in planes[1:]:
                aa <<= self.word(8)
                np.bitwise_or(aa, plane[b:e], out=aa, casting="unsafe")
            np.right_shift(aa, 1, out=o[b:e])
            np.left_shift(aa, self.bits - 1, out=tt)
            o[b:e] |= tt


# Complex numbers are pairs of floats: coded as their real dtype.
_BY_DTYPE = {torch.bfloat16: Bf16Layout(), torch.float32: Fp32Layout(), torch.complex64: Fp32Layout(),
             torch.float16: Fp16Layout(), torch.complex32: Fp16Layout(), torch.float64: RotatedLayout(8),
             torch.complex128: RotatedLayout(8)}


def layout_for(dtype: torch.dtype):
    """The float layout for `dtype`, or None (integers, bools, 1-byte floats: plain zstd)."""
    return _BY_DTYPE.get(dtype)
