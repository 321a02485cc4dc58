"""How each float dtype is cut into byte planes, and put back together (SOTA-437, LIT-750).

In trained floats only the exponent (and, weakly, the top mantissa bits) is redundant; sign and low
mantissa bits look random. Each layout isolates the 8-bit exponent as one plane (packed two 4-bit codes
per byte, planes.py) and cuts the remaining bits into byte planes that are Huffman-coded when a sample
of them shrinks and stored raw otherwise. The bit placement was chosen per dtype for size and for a
cheap join (measured on trained MiniLM weights, docs/checkpointing.md):

  bf16  s|E|m7:   E (8 bits)        + [s m6..m0]
  fp32  s|E|m23:  E (8 bits)        + [s m22..m16] [m15..m8] [m7..m0]   (sign rides with the top
                  mantissa bits, which are noise anyway, so fp16-exact values leave whole zero bytes)
                  When both low bytes are noise (the gate of streams.py, on the samples it would take
                  of each plane) they travel as one stored plane of 16-bit words, [m15..m0] (format 5).
  fp16  s|E5|m10: [s E5 m9 m8] + [m7..m0]: the plain high and low bytes. The high byte is one Huffman
                  symbol per element anyway (5-bit exponent); moving the sign out is 0.04% smaller
                  but was not worth a costlier join.
  fp64 and other widths: rotate left one bit (sign next to the mantissa), top two bytes entropy-coded.

The bf16, fp32 and fp16 splits and joins are compiled loops (kernels.py, one pass per chunk); the
rotated layout stays in numpy, a block at a time.

A layout's `split(raw)` returns (exponent plane or None, [(kind, plane)]) with kind "e" (entropy-code),
"m" (probe, then code or store) or "s" (store: already probed); `plane_sizes(n)` lists the plane
sizes in bytes a chunk of n elements may decode to; `join(exponent, planes, out)` rebuilds the bytes into `out`, where
`exponent` is None, a plain exponent plane, or (packed codes, escaped exponents, base) from planes.py.
Planes are per-thread scratch: valid until the same thread splits again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
import torch

from islands.checkpoint.codec.planes import (
    BLOCK_WORDS,
    MAX_ESCAPE_SHARE,
    SAMPLE_SIZE,
    compiled_kernels,
    scratch,
    window_base,
)
from islands.checkpoint.codec.streams import GATE_MIN_BYTES, is_noise


def _blocks(n: int):
    for b in range(0, n, BLOCK_WORDS):
        yield b, min(n, b + BLOCK_WORDS)


def _pairs(x: np.ndarray, even: int, pair) -> np.ndarray:
    return x[:even].view(pair)


class _ExponentWords(ABC):
    """Shared split and join for layouts whose exponent sits at bits [shift, shift+8) of each word.

    Subclasses set size, word, shift, planes (how many non-exponent planes follow the exponent) and
    the calls of the compiled loops: _split_pairs(x, even, base, packed, planes), _join_packed(packed,
    base, planes, out) and _join_plain(exponent, planes, out); the loops finish an odd last element.
    """

    size: int
    word: type[np.unsignedinteger]
    shift: int
    planes: int

    @abstractmethod
    def _split_pairs(self, x: np.ndarray, even: int, base: int, packed: np.ndarray, planes: list[np.ndarray]) -> None:
        """The layout's compiled loop (class docstring)."""

    @abstractmethod
    def _join_packed(self, packed: np.ndarray, base: int, planes: list[np.ndarray], o: np.ndarray) -> None:
        """The layout's compiled loop (class docstring)."""

    @abstractmethod
    def _join_plain(self, exponent: np.ndarray, planes: list[np.ndarray], o: np.ndarray) -> None:
        """The layout's compiled loop (class docstring)."""

    def split(self, raw: np.ndarray):
        """Exponents as 4-bit codes two per byte, the other planes from the same pass; the plain
        exponent plane only if too many exponents escape (more than 1/64, or fewer than 2 elements)."""
        x = raw.view(self.word)
        n = x.size
        kinds, planes = self._new_planes(x)
        base = window_base(((x[:: (n // SAMPLE_SIZE) | 1] >> self.shift) & 0xFF).astype(np.uint8)) if n >= 2 else 0
        packed = scratch(f"split.{self.size}.packed", (n + 1) // 2, np.uint8)
        self._split_pairs(x, n // 2 * 2, base, packed, planes)  # the other planes are needed either way
        if n >= 2:
            escaped = scratch("split.escaped", int(n * MAX_ESCAPE_SHARE), np.uint8)
            k = compiled_kernels().collect_escapes(packed, n, x, self.shift, escaped)
            if k >= 0:
                return (base, packed, escaped[:k]), list(zip(kinds, planes))
        exp = scratch(f"split.{self.size}.E", n, np.uint8)
        v = scratch(f"split.{self.size}.v", min(n, BLOCK_WORDS), self.word)
        for b, e in _blocks(n):
            np.right_shift(x[b:e], self.shift, out=v[: e - b])
            np.copyto(exp[b:e], v[: e - b], casting="unsafe")  # the cast drops the sign above E
        return exp, list(zip(kinds, planes))

    def _new_planes(self, x: np.ndarray) -> tuple[list[str], list[np.ndarray]]:
        """(kinds, empty planes) that the split fills: one probed byte plane per non-exponent byte."""
        return ["m"] * self.planes, [scratch(f"split.{self.size}.{k}", x.size, np.uint8) for k in range(self.planes)]

    def plane_sizes(self, n: int) -> list[list[int]]:
        return [[n] * self.planes]

    def join(self, exponent, planes: list[np.ndarray], out: np.ndarray) -> None:
        o = out.view(self.word)
        if not isinstance(exponent, tuple):
            self._join_plain(exponent, planes, o)
            return
        packed, escaped, base = exponent
        self._join_packed(packed, base, planes, o)
        found = compiled_kernels().patch_escapes(packed, o.size, escaped, o, self.shift)
        if found != escaped.size:
            raise ValueError(f"{found} escape codes but {escaped.size} escaped exponents")


class Bf16Layout(_ExponentWords):
    size, word, shift, planes = 2, np.uint16, 7, 1

    def _split_pairs(self, x, even, base, packed, planes):
        low = planes[0]
        compiled_kernels().split_bf16(_pairs(x, even, np.uint32), base, packed, _pairs(low, even, np.uint16), x, low)

    def _join_packed(self, packed, base, planes, o):
        even = o.size // 2 * 2
        low = planes[0]
        compiled_kernels().join_bf16(packed, base, _pairs(low, even, np.uint16), _pairs(o, even, np.uint32), low, o)

    def _join_plain(self, exponent, planes, o):
        compiled_kernels().join_bf16_plain(exponent, planes[0], o)


_NO_PLANE = np.zeros(0, np.uint8)


class Fp32Layout(_ExponentWords):
    size, word, shift, planes = 4, np.uint32, 23, 3

    def _new_planes(self, x: np.ndarray) -> tuple[list[str], list[np.ndarray]]:
        """The top byte plane, and the low 16 bits as one stored word plane when the gate would store
        both of their byte planes anyway (it samples the same elements here as it would there)."""
        n = x.size
        if n >= GATE_MIN_BYTES:
            s = x[:: (n // SAMPLE_SIZE) | 1]
            if is_noise((s & 0xFF).astype(np.uint8)) and is_noise(((s >> 8) & 0xFF).astype(np.uint8)):
                return ["m", "s"], [scratch("split.4.0", n, np.uint8), scratch("split.4.low", n, np.uint16)]
        return super()._new_planes(x)

    def plane_sizes(self, n: int) -> list[list[int]]:
        return [[n, n, n], [n, 2 * n]]

    @staticmethod
    def _top_mid_low(planes):
        """(top, mid, low) for the kernels: mid is empty when the low 16 bits travel as words."""
        if len(planes) == 2:  # the low half as words (decoded planes are bytes; scratch starts aligned)
            return planes[0], _NO_PLANE, planes[1].view(np.uint16)
        return tuple(planes)

    def _split_pairs(self, x, even, base, packed, planes):
        top, mid, low = self._top_mid_low(planes)
        compiled_kernels().split_fp32(_pairs(x, even, np.uint64), base, packed, top, mid, low, x)

    def _join_packed(self, packed, base, planes, o):
        compiled_kernels().join_fp32(packed, base, *self._top_mid_low(planes), o)

    def _join_plain(self, exponent, planes, o):
        compiled_kernels().join_fp32_plain(exponent, *self._top_mid_low(planes), o)


class Fp16Layout:
    """The high and low bytes as they are: one entropy-coded, one probed (see the module docstring)."""

    size, word, planes = 2, np.uint16, 2

    def plane_sizes(self, n: int) -> list[list[int]]:
        return [[n, n]]

    def split(self, raw: np.ndarray):
        x = raw.view(np.uint16)
        high, low = scratch("fp16.H", x.size, np.uint8), scratch("fp16.L", x.size, np.uint8)
        compiled_kernels().split_fp16(x, high, low)
        return None, [("e", high), ("m", low)]

    def join(self, exponent, planes, out: np.ndarray) -> None:
        compiled_kernels().join_fp16(planes[0], planes[1], out.view(np.uint16))


class RotatedLayout:
    """Any width: rotate left one bit (exponent on a byte boundary), cut into byte planes, top first."""

    # fp64's 11-bit exponent spans the top byte and 3 bits of the next
    planes_entropy: ClassVar[dict[int, int]] = {8: 2}

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
            aa, tt = a[: e - b], t[: e - b]
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
            aa, tt = a[: e - b], t[: e - b]
            np.copyto(aa, planes[0][b:e], casting="unsafe")
            for plane in planes[1:]:
                aa <<= self.word(8)
                np.bitwise_or(aa, plane[b:e], out=aa, casting="unsafe")
            np.right_shift(aa, 1, out=o[b:e])
            np.left_shift(aa, self.bits - 1, out=tt)
            o[b:e] |= tt


# Complex numbers are pairs of floats: coded as their real dtype.
_BY_DTYPE = {
    torch.bfloat16: Bf16Layout(),
    torch.float32: Fp32Layout(),
    torch.complex64: Fp32Layout(),
    torch.float16: Fp16Layout(),
    torch.complex32: Fp16Layout(),
    torch.float64: RotatedLayout(8),
    torch.complex128: RotatedLayout(8),
}


def layout_for(dtype: torch.dtype):
    """The float layout for `dtype`, or None (integers, bools, 1-byte floats: plain zstd)."""
    return _BY_DTYPE.get(dtype)
