"""Compiled split and join loops for the codec's float layouts (SOTA-437, LIT-750), via numba.

Why compiled: a numpy pass reads and writes a whole array, so rebuilding bf16 words from a packed
exponent code and a sign|mantissa byte took 6 such passes per block (~6 ms for 11.7 M elements on one
thread) where one fused loop runs at copy speed (~2 ms: measured against a plain memcpy of the output).
That join was 60% of our decode, and the reason ZipNN (C) decoded per tensor 2x faster than we did.

Each loop works on pairs of elements, because a packed byte holds two exponent codes (planes.py:
code 2i in the low nibble, 2i+1 in the high; code 15 escapes, the escaped exponents follow in order).
Output and input words are viewed as pairs (uint32 for two uint16 words, uint64 for two uint32) so the
loops compile to straight SIMD code. Escapes are rare (< 1/64 by construction): the main loops write
base + 15 for them and `patch_escapes` finds them sixteen codes at a time and writes the real exponent.

The bytes are exactly those of the numpy formulation they replace: the blob format does not change.
Every kernel releases the GIL (nogil), so an asynchronous persist does not hold up the training thread.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# every kernel: no GIL, compiled once per machine (on-disk cache), no bounds checks
_kernel = njit(nogil=True, cache=True, boundscheck=False)

_NIBBLE_LOW3 = np.uint64(0x7777777777777777)
_NIBBLE_ONES = np.uint64(0x1111111111111111)
_NIBBLE_HIGH_BITS = np.uint64(0x8888888888888888)


@_kernel
def _code(exponent, base):
    """(exponent - base) mod 256, clamped to the escape code 15."""
    return min((exponent - base) & np.uint32(0xFF), np.uint32(15))


# ---- bf16: s|E8|m7 -> packed E codes + one byte [s m6..m0] -----------------------------------------
# Each split and join works on whole pairs through `*_pairs` views of the arrays and finishes an odd
# last element from the arrays themselves, with the same bit formulas.


@_kernel
def _bf16_low(w):
    """[s m6..m0] of the bf16 word(s) in the low 16 bits of w."""
    return ((w >> 8) & 0x80) | (w & 0x7F)


@_kernel
def _bf16_rest(lo):
    """The sign and mantissa bits of a bf16 word from its [s m6..m0] byte."""
    return (lo & 0x7F) | ((lo & 0x80) << 8)


@_kernel
def split_bf16(pairs, base, packed, low_pairs, words, low):
    """pairs: `words` two at a time (uint32); fills packed (one byte per pair) and low_pairs (uint16, the
    same memory as `low`)."""
    b = np.uint32(base)
    for j in range(pairs.size):
        w = np.uint32(pairs[j])
        packed[j] = np.uint8(_code((w >> 7) & 0xFF, b) | (_code((w >> 23) & 0xFF, b) << 4))
        low_pairs[j] = np.uint16(_bf16_low(w) | (_bf16_low(w >> 16) << 8))
    if words.size & 1:
        w = np.uint32(words[words.size - 1])
        packed[packed.size - 1] = np.uint8(_code((w >> 7) & 0xFF, b))
        low[low.size - 1] = np.uint8(_bf16_low(w))


@_kernel
def join_bf16(packed, base, low_pairs, out_pairs, low, out):
    """Inverse of split_bf16; escaped codes come out as base + 15 (see patch_escapes)."""
    b = np.uint32(base) * np.uint32(0x00800080)  # base at both words' exponent fields
    for j in range(out_pairs.size):
        p = np.uint32(packed[j])
        lo = np.uint32(low_pairs[j])
        # p * (1 << 7 | 1 << 19): the low nibble lands at bits 7-10, the high one at 23-26; the rest is
        # _bf16_rest of both bytes, spelled out on the pair (two calls on masked bytes measured slower)
        e = ((p * np.uint32(0x00080080)) & np.uint32(0x07800780)) + b
        out_pairs[j] = e | (lo & 0x7F) | ((lo & 0x80) << 8) | ((lo & 0x7F00) << 8) | ((lo & 0x8000) << 16)
    if out.size & 1:
        p = np.uint32(packed[packed.size - 1])
        out[out.size - 1] = np.uint16((((p & 15) + np.uint32(base)) << 7) | _bf16_rest(np.uint32(low[low.size - 1])))


@_kernel
def join_bf16_plain(exponent, low, out):
    """bf16 words from a whole exponent plane (too many escapes to pack) and the [s m6..m0] plane."""
    for i in range(out.size):
        out[i] = np.uint16((np.uint32(exponent[i]) << 7) | _bf16_rest(np.uint32(low[i])))


# ---- fp32: s|E8|m23 -> packed E codes + [s m22..m16] + ([m15..m8], [m7..m0]) or [m15..m0] --------------


@_kernel
def _fp32_split_one(w, top, mid, low, i, words):
    """Element i's planes from its word w (uint32): the [s m22..m16] byte and the low 16 bits."""
    top[i] = np.uint8(((w >> 24) & 0x80) | ((w >> 16) & 0x7F))
    if words:
        low[i] = np.uint16(w & 0xFFFF)
    else:
        mid[i] = np.uint8((w >> 8) & 0xFF)
        low[i] = np.uint8(w & 0xFF)


@_kernel
def split_fp32(pairs, base, packed, top, mid, low, words_in):
    """pairs: `words_in` two at a time (uint64); fills packed, the [s m22..m16] plane `top`, and the low
    16 bits as two byte planes (`mid` and `low` uint8, one per element) or, when `mid` is empty, as one
    plane of uint16 words (`low`)."""
    b = np.uint32(base)
    words = mid.size == 0
    for j in range(pairs.size):
        w = np.uint64(pairs[j])
        w0 = np.uint32(w & np.uint64(0xFFFFFFFF))
        w1 = np.uint32(w >> np.uint64(32))
        packed[j] = np.uint8(_code((w0 >> 23) & 0xFF, b) | (_code((w1 >> 23) & 0xFF, b) << 4))
        _fp32_split_one(w0, top, mid, low, 2 * j, words)
        _fp32_split_one(w1, top, mid, low, 2 * j + 1, words)
    n = words_in.size
    if n & 1:
        w = np.uint32(words_in[n - 1])
        packed[packed.size - 1] = np.uint8(_code((w >> 23) & 0xFF, b))
        _fp32_split_one(w, top, mid, low, n - 1, words)


@_kernel
def _fp32_rest(t, mid, low, i, words):
    """Every bit of an fp32 word but its exponent, from the top plane's byte t and the low planes."""
    r = ((t & np.uint32(0x80)) << 24) | ((t & np.uint32(0x7F)) << 16)
    if words:
        return r | np.uint32(low[i])
    return r | (np.uint32(mid[i]) << 8) | np.uint32(low[i])


@_kernel
def join_fp32(packed, base, top, mid, low, out):
    """Inverse of split_fp32 (`out` uint32, even or odd length); escaped codes come out as base + 15."""
    b = np.uint32(base)
    words = mid.size == 0
    n = out.size
    for j in range(n // 2):
        p = np.uint32(packed[j])
        out[2 * j] = (((p & 15) + b) << 23) | _fp32_rest(np.uint32(top[2 * j]), mid, low, 2 * j, words)
        out[2 * j + 1] = (((p >> 4) + b) << 23) | _fp32_rest(np.uint32(top[2 * j + 1]), mid, low, 2 * j + 1, words)
    if n & 1:
        p = np.uint32(packed[n // 2])
        out[n - 1] = (((p & 15) + b) << 23) | _fp32_rest(np.uint32(top[n - 1]), mid, low, n - 1, words)


@_kernel
def join_fp32_plain(exponent, top, mid, low, out):
    words = mid.size == 0
    for i in range(out.size):
        out[i] = (np.uint32(exponent[i]) << 23) | _fp32_rest(np.uint32(top[i]), mid, low, i, words)


# ---- fp16: the high and low bytes as they are --------------------------------------------------------


@_kernel
def split_fp16(words, high, low):
    for i in range(words.size):
        w = np.uint16(words[i])
        high[i] = np.uint8(w >> 8)
        low[i] = np.uint8(w & 0xFF)


@_kernel
def join_fp16(high, low, out):
    for i in range(out.size):
        out[i] = (np.uint16(high[i]) << 8) | np.uint16(low[i])


# ---- escapes ---------------------------------------------------------------------------------------


@_kernel
def _escape_bits(x):
    """Bit 4k+3 set iff nibble k of x is 15: its low three bits carry into bit 3, and bit 3 was set."""
    return ((x & _NIBBLE_LOW3) + _NIBBLE_ONES) & x & _NIBBLE_HIGH_BITS


@_kernel
def _escape_positions(packed, n, pos):
    """Write the indices (< n) of the codes equal to 15 into `pos`, in order, sixteen codes per 64-bit
    word; returns how many there are, counting on past pos.size (those are not written)."""
    k = 0
    full = packed.size // 8
    blocks = packed[: full * 8].view(np.uint64)
    for w in range(full):
        t = _escape_bits(blocks[w])
        while t:
            i = w * 16 + (_lowest_set_bit(t) >> 2)
            t &= t - np.uint64(1)
            if i < n:
                if k < pos.size:
                    pos[k] = i
                k += 1
    for j in range(full * 8, packed.size):
        for q in range(2):
            i = 2 * j + q
            if i < n and (packed[j] >> (4 * q)) & 15 == 15:
                if k < pos.size:
                    pos[k] = i
                k += 1
    return k


@_kernel
def collect_escapes(packed, n, words, shift, escaped):
    """Write the exponents ((word >> shift) & 0xFF) of the first n codes equal to 15 into `escaped`, in
    order; returns how many there are, or -1 if there are more than escaped.size."""
    pos = np.empty(escaped.size, np.int64)
    k = _escape_positions(packed, n, pos)
    if k > escaped.size:
        return -1
    for j in range(k):
        escaped[j] = np.uint8((np.uint64(words[pos[j]]) >> np.uint64(shift)) & np.uint64(0xFF))
    return k


@_kernel
def patch_escapes(packed, n, escaped, out, shift):
    """Put the escaped exponents (in order) into the exponent fields of `out` at the codes equal to 15.

    Returns how many codes were 15 among the first n; a caller compares it with escaped.size, since a
    mismatch means damaged streams (extra escapes are counted but not written).
    """
    s = np.uint64(shift)
    keep = ~(np.uint64(0xFF) << s)
    pos = np.empty(escaped.size, np.int64)
    k = _escape_positions(packed, n, pos)
    for j in range(min(k, escaped.size)):
        out[pos[j]] = (np.uint64(out[pos[j]]) & keep) | (np.uint64(escaped[j]) << s)
    return k


@_kernel
def _lowest_set_bit(t):
    """Index of the lowest set bit of a non-zero uint64."""
    i = 0
    while not (t >> np.uint64(i)) & np.uint64(1):
        i += 1
    return i
