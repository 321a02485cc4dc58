"""Compiled CPU loops (numba) for shared-scale int8/int4 quantisation (quantize.SharedScaleQuant), with torch's own
CPU random numbers drawn inside the pass.

Stochastic rounding needs one uniform per value. `torch.rand(n, generator=g)` on the CPU draws them one at a time
from g's MT19937 engine (a 32-bit output, its low 24 bits times 2**-24) in a serial loop, and at 100M values that
was 0.28 s into a buffer (0.44 s into a fresh one) against 0.04 s for the rounding itself: most of a round. Here
the same engine runs inside the rounding pass: its state is read out of the torch.Generator (`get_state`), its
624-word blocks regenerated and tempered a chunk of values at a time into a buffer that stays in L1, and the
state written back (`set_state`) where torch would have left it. The uniforms, the codes and the generator's
state after the call are bit for bit torch.rand's, so a checkpointed generator, a resumed run and the torch path
(any device, or USE_KERNELS off) all agree; `matches_torch` checks that once per process against torch.rand itself
and the caller keeps torch.rand where it does not hold (another torch's generator layout).

The rounding is kernels.shared_scale_wire's: the same fp32 operations in the same order. The decoders write
fp32(code) * factor (int8), or fp32(nibble - offset) * factor (int4), as torch.mul's promotion and
kernels.nibbles_decode do, and `subtract_wire` is error feedback's x - decode(payload) in place.

All kernels release the GIL and compile once per machine (on-disk cache).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import njit

_kernel = njit(nogil=True, cache=True, boundscheck=False)

# MT19937 (Matsumoto and Nishimura), as ATen's at::mt19937 runs it
MT_N = 624
_MT_M = 397
_UPPER = np.uint32(0x80000000)
_LOWER = np.uint32(0x7FFFFFFF)
_MATRIX_A = np.uint32(0x9908B0DF)
_LOW24 = np.uint32(0xFFFFFF)
_TWO_M24 = np.float32(2.0**-24)  # uniform_real<float>: (bits & (2**24 - 1)) * 2**-24

# values per chunk of the rounding pass: their uniforms (16 KB) stay in L1 between the engine and the rounding; even,
# so a chunk starts on a whole byte of nibbles
CHUNK = 4096

# torch's CPUGeneratorImplState (x86-64 and arm64 layout): the_initial_seed u64, left i32, seeded i32, next u64,
# state u64[624], then the normal-sample cache, which this leaves as it is
_STATE_BYTES = 5056
_LEFT = slice(8, 12)
_NEXT = slice(16, 24)
_WORDS = slice(24, 24 + 8 * MT_N)


@njit(inline="always")
def _code(x, scale, s, u):
    """floor(y) + (u < y - floor(y)), y = clamp(x / scale * s, -s, s): kernels.shared_scale_wire's fp32 operations
    (torch's, in torch's order)."""
    y = min(max(np.float32(x / scale) * s, -s), s)
    low = np.floor(y)
    return low + (np.float32(1.0) if u < y - low else np.float32(0.0))


@njit(inline="always")
def _twist(u, v):
    """MT19937's recurrence term of two consecutive words: (upper bit of u, lower 31 of v) >> 1, xor A if v is odd."""
    y = np.uint32((u & _UPPER) | (v & _LOWER))  # np.uint32 after each op keeps numba's ints (int64) in 32-bit lanes
    return np.uint32((y >> np.uint32(1)) ^ (np.uint32(np.uint32(0) - (v & np.uint32(1))) & _MATRIX_A))


@_kernel
def _refill(mt):
    """The next 624 words of the engine in place (at::mt19937::next_state)."""
    for j in range(MT_N - _MT_M):
        mt[j] = np.uint32(mt[j + _MT_M] ^ _twist(mt[j], mt[j + 1]))
    for j in range(MT_N - _MT_M, MT_N - 1):
        mt[j] = np.uint32(mt[j + _MT_M - MT_N] ^ _twist(mt[j], mt[j + 1]))
    mt[MT_N - 1] = np.uint32(mt[_MT_M - 1] ^ _twist(mt[MT_N - 1], mt[0]))


@_kernel
def uniforms(mt, pos, out):
    """out[:] = the engine's next out.size uniforms, as torch.rand gives them in fp32; mt (uint32, 624) is the
    engine's words, pos how many of them are used (624: a new block is due). Returns the new pos."""
    i = 0
    n = out.size
    while i < n:
        if pos == MT_N:
            _refill(mt)
            pos = 0
        m = min(MT_N - pos, n - i)
        # loops over slices from 0: an index numba knows is not negative vectorises (base + t did not, 5x slower)
        words = mt[pos : pos + m]
        dest = out[i : i + m]
        for t in range(m):  # tempering, then uniform_real<float>
            y = words[t]
            y = np.uint32(y ^ (y >> np.uint32(11)))
            y = np.uint32(y ^ ((y << np.uint32(7)) & np.uint32(0x9D2C5680)))
            y = np.uint32(y ^ ((y << np.uint32(15)) & np.uint32(0xEFC60000)))
            y = np.uint32(y ^ (y >> np.uint32(18)))
            dest[t] = np.float32(np.int32(y & _LOW24)) * _TWO_M24
        i += m
        pos += m
    return pos


@_kernel
def shared_scale_wire(x, scale, levels, nibbles, mt, pos, wire):
    """kernels.shared_scale_wire with the uniforms drawn here, a chunk at a time, from the engine (mt, pos as in
    `uniforms`): int8 codes (wire int8, len n), or (nibbles) code + levels as nibbles, element 2i low (wire uint8,
    len ceil(n / 2)). Returns (ok, pos): ok False as soon as some x / scale * levels is NaN (wire then partly
    written, mt advanced): the caller restores the engine and takes torch's ops, whose NaN handling this does not
    copy."""
    s = np.float32(levels)
    scale = np.float32(scale)
    n = x.size
    u = np.empty(CHUNK, np.float32)
    for lo in range(0, n, CHUNK):
        m = min(CHUNK, n - lo)
        pos = uniforms(mt, pos, u[:m])
        xs = x[lo : lo + m]
        bad = False
        for t in range(m):
            y = np.float32(xs[t] / scale) * s
            bad |= y != y
        if bad:
            return False, pos
        if not nibbles:
            ws = wire[lo : lo + m]
            for t in range(m):
                ws[t] = np.int8(_code(xs[t], scale, s, u[t]))
            continue
        ws = wire[lo // 2 : (lo + m + 1) // 2]
        for t in range(m // 2):
            c0 = np.uint8(_code(xs[2 * t], scale, s, u[2 * t]) + s)
            c1 = np.uint8(_code(xs[2 * t + 1], scale, s, u[2 * t + 1]) + s)
            ws[t] = c0 | (c1 << np.uint8(4))
        if m % 2:  # the vector's last value, alone in its byte
            ws[m // 2] = np.uint8(_code(xs[m - 1], scale, s, u[m - 1]) + s)
    return True, pos


@_kernel
def int8_decode(wire, factor, out):
    """out[i] = fp32(wire[i]) * factor: torch.mul(int8 codes, an fp32 factor), which promotes each code to fp32."""
    f = np.float32(factor)
    for i in range(out.size):
        out[i] = np.float32(wire[i]) * f
    return out


@_kernel
def subtract_wire(x, wire, nibbles, offset, factor):
    """x[i] -= the decoded value i, in place: x - decompress(payload) with decompress's fp32 operations, int8
    codes or (nibbles) nibble - offset, element 2j the low half of wire[j]."""
    f = np.float32(factor)
    n = x.size
    if not nibbles:
        for i in range(n):
            x[i] = x[i] - np.float32(wire[i]) * f
        return x
    for j in range(n // 2):
        b = np.int16(wire[j])
        x[2 * j] = x[2 * j] - np.float32((b & np.int16(15)) - offset) * f
        x[2 * j + 1] = x[2 * j + 1] - np.float32((b >> np.int16(4)) - offset) * f
    if n % 2:
        x[n - 1] = x[n - 1] - np.float32((np.int16(wire[n // 2]) & np.int16(15)) - offset) * f
    return x


# ---- the engine's state in and out of a torch.Generator ------------------------------------------------------


def engine(gen: torch.Generator) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(the generator's state bytes, its 624 words as uint32, how many of them are used) of a CPU generator; None
    for a state at::mt19937 does not leave (the caller then draws with torch.rand)."""
    raw = gen.get_state().numpy()
    if raw.size != _STATE_BYTES:
        return None
    left = int(raw[_LEFT].view(np.int32)[0])
    nxt = int(raw[_NEXT].view(np.uint64)[0])
    # at::mt19937 draws while --left > 0, from state[next++]: 624 - (left - 1) words of this block are used, and
    # next counts them, except where left is 1 (a new block is due, next unread)
    if not 1 <= left <= MT_N or (left != 1 and nxt != MT_N + 1 - left):
        return None
    return raw, raw[_WORDS].view(np.uint64).astype(np.uint32), MT_N + 1 - left


def store(gen: torch.Generator, raw: np.ndarray, words: np.ndarray, pos: int) -> None:
    """Write the engine back into `gen` where torch's own draws would have left it (raw: `engine`'s bytes); left as
    it is when nothing was drawn (a fresh seed's next word is 0 where this would store 624)."""
    if pos == MT_N + 1 - int(raw[_LEFT].view(np.int32)[0]) and np.array_equal(words, raw[_WORDS].view(np.uint64)):
        return
    raw = raw.copy()
    raw[_LEFT] = np.array([MT_N + 1 - pos], np.int32).view(np.uint8)
    raw[_NEXT] = np.array([pos], np.uint64).view(np.uint8)
    raw[_WORDS] = words.astype(np.uint64).view(np.uint8)
    gen.set_state(torch.from_numpy(raw))


@functools.cache
def matches_torch() -> bool:
    """Whether this torch's CPU generator has the layout and the draws this module assumes: the uniforms and the
    state after them equal torch.rand's, from a fresh seed and from the middle of a block, once per process."""
    gen, ref = torch.Generator().manual_seed(20240), torch.Generator().manual_seed(20240)
    if gen.get_state().numel() != _STATE_BYTES:
        return False
    for n in (5, 1000, 700):
        state = engine(gen)
        if state is None:
            return False
        raw, words, pos = state
        u = np.empty(n, np.float32)
        pos = uniforms(words, pos, u)
        store(gen, raw, words, pos)
        if not np.array_equal(u.view(np.uint32), torch.rand(n, generator=ref).numpy().view(np.uint32)):
            return False
    return torch.equal(gen.get_state(), ref.get_state())
