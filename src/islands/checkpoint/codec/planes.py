"""Exponent pair packing (its definition) and per-thread scratch for the codec (SOTA-437, LIT-750).

Pair packing (for an 8-bit exponent plane: bf16, fp32): trained weights use few exponents (LIT-750:
~40 values; 15 adjacent values hold >99.9% in the MiniLM weights we measure), so each exponent becomes
a 4-bit code, offset from the chunk's most used 15-wide window, and two codes share a byte. Code 15
escapes: those exponents are kept whole, in order, in a side stream. The entropy coder then reads half
as many bytes (measured: 2.600 vs 2.611 bits per exponent, and half the Huffman decode time).

The split and join loops that apply this to whole words are compiled (kernels.py); this module keeps
the format's plain-numpy definition (`pack_exponents`, `unpack_exponents`, which tests hold the
kernels to), the window and entropy estimates, and the per-thread scratch buffers: fresh multi-MB
arrays cost more in page faults than the arithmetic (measured 15.7 vs 4.6 ms for 16 MB).
"""

from __future__ import annotations

import threading

import numpy as np

ESCAPE = 15
_WINDOW = 15  # exponent values per code window (code 15 is the escape)
MAX_ESCAPE_SHARE = 1 / 64  # beyond this the plain plane is cheaper than the escape stream
SAMPLE_SIZE = 8192  # exponents sampled to choose the window (an odd stride: no power-of-2 row aliasing)
BLOCK_WORDS = 1 << 16  # elements per numpy step: a block and its temporaries stay within the 1 MiB L2

_SCRATCH = threading.local()


def scratch(tag: str, n: int, dtype) -> np.ndarray:
    """This thread's reusable array `tag` with room for n elements (its first n), never zero-filled.

    Sized by the largest chunk seen, so memory stays bounded by TensorCodec.chunk_bytes per tag.
    """
    cache = getattr(_SCRATCH, "arrays", None)
    if cache is None:
        cache = _SCRATCH.arrays = {}
    arr = cache.get(tag)
    if arr is None or arr.size < n or arr.dtype != np.dtype(dtype):
        arr = cache[tag] = np.empty(max(n, 8), dtype)
    return arr[:n]


def window_base(sample: np.ndarray) -> int:
    """Lowest exponent of the 15-wide window holding most of `sample` (8-bit exponents)."""
    hist = np.bincount(sample, minlength=256)
    return int(np.convolve(hist, np.ones(_WINDOW, dtype=np.int64), mode="valid").argmax())


def sampled_entropy_bits(plane: np.ndarray, samples: int = SAMPLE_SIZE) -> float:
    """Order-0 entropy (bits per byte) of ~`samples` bytes taken at an odd stride across all of `plane`,
    plus the Miller-Madow correction for a small sample ((K-1)/(2N ln 2) for K distinct bytes seen)."""
    sample = plane[:: (plane.size // samples) | 1]
    counts = np.bincount(sample, minlength=256)
    seen = counts[counts > 0]
    p = seen / sample.size
    return float(-(p * np.log2(p)).sum() + (seen.size - 1) / (2 * sample.size * np.log(2)))


def pack_exponents(x: np.ndarray) -> tuple[int, np.ndarray, np.ndarray] | None:
    """(base, packed codes, escaped exponents) for a plane of 8-bit exponents; None if too many escape.

    The packed format in plain numpy, for reading and for tests: kernels.py writes the same bytes in
    one fused pass. Byte i holds code 2i in its low nibble and code 2i+1 in its high one (a last odd
    code is paired with 0); code c < 15 stands for exponent base + c, code 15 for the next escaped one.
    """
    n = x.size
    if n < 2:
        return None
    base = window_base(x[:: (n // SAMPLE_SIZE) | 1])
    codes = np.zeros(2 * ((n + 1) // 2), np.uint8)
    np.minimum(x - np.uint8(base), ESCAPE, out=codes[:n])  # uint8 arithmetic wraps: mod 256
    pos = np.flatnonzero(codes == ESCAPE)
    if pos.size > n * MAX_ESCAPE_SHARE:
        return None
    return base, codes[0::2] | (codes[1::2] << 4), x[pos]


def unpack_exponents(packed: np.ndarray, escaped: np.ndarray, base: int, n: int) -> np.ndarray:
    """Inverse of pack_exponents as a plain byte plane. Raises ValueError if the streams do not fit."""
    if packed.size != (n + 1) // 2:
        raise ValueError(f"{packed.size} packed bytes cannot hold {n} exponent codes")
    codes = np.stack([packed & 0x0F, packed >> 4], axis=1).reshape(-1)[:n]
    pos = np.flatnonzero(codes == ESCAPE)
    if pos.size != escaped.size:
        raise ValueError(f"{pos.size} escape codes but {escaped.size} escaped exponents")
    out = codes + np.uint8(base)
    out[pos] = escaped
    return out


_KERNELS = None


def compiled_kernels():
    """kernels.py, imported on first use: numba costs ~0.5 s to import, which a process that never
    touches a checkpoint (most test workers, `islands train` without --ckpt-dir) should not pay."""
    global _KERNELS
    if _KERNELS is None:
        import islands.checkpoint.codec.kernels as kernels

        _KERNELS = kernels
    return _KERNELS
