"""Compiled CPU loop (numba) for dct-topk's inverse transform on the CPU (dct.DCTTopK.inverse, subtract_sent).

A decoded coefficient vector is sparse: 2.15% of the coefficients were sent, about 1.4 per block of 64, yet the
matrix product (blocks x D) spends 64 x 64 multiply-adds on every block, 0.18 s at 100M values on one thread. Here a
block's values are the sum of fp32(y_k * D[k, :]) over its non-zero coefficients y_k, k ascending, added one at a time
in fp32 from +0: one pass that reads the coefficients and writes the block, the products only where y_k != 0.

Skipping y_k == 0 changes nothing: its product is a zero, and x + (+-0) is x for any x other than -0, which the sum,
starting from +0, never holds. So the result is the same, bit for bit, as the dense sequential sum over all 64
coefficients that DCTTopK.inverse's torch path computes (a product, then an add, per k: no fused multiply-add, here
either, numba's default). It is not the matrix product's rounding (BLAS sums in its own order, with FMAs): the
decoded tensor may differ from the old one in the last bits where a block had two or more coefficients.

Compiled once per machine (on-disk cache), GIL released.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_kernel = njit(nogil=True, cache=True, boundscheck=False)


@_kernel
def block_inverse(y, basis, out, subtract):
    """For each block b of basis.shape[0] values: v = sum over k ascending with y[b, k] != 0 of y[b, k] * basis[k, :]
    (fp32, from +0), written to out's values of that block (out[i] = v, or with `subtract` out[i] -= v). out may be
    shorter than y (a padded last block: its extra values are dropped). y (flat, a whole number of blocks) and out
    fp32, basis (B, B) fp32 C-contiguous. A block's non-zero coefficients are found first by a branch-free scan
    (their k appended, the end moved by the compare): a branch per coefficient, and a slice assignment zeroing the
    sum, made this 3x slower."""
    size = basis.shape[0]
    n = out.size
    acc = np.empty(size, np.float32)
    nonzero = np.empty(size, np.int64)
    for b in range(y.size // size):
        lo = b * size
        coeffs = y[lo : lo + size]
        count = 0
        for k in range(size):
            nonzero[count] = k
            count += coeffs[k] != 0.0  # a NaN too
        for j in range(size):
            acc[j] = 0.0
        for q in range(count):
            k = nonzero[q]
            c = coeffs[k]
            row = basis[k]
            for j in range(size):
                acc[j] = acc[j] + c * row[j]
        m = min(size, n - lo)
        dest = out[lo : lo + m]
        if subtract:
            for j in range(m):
                dest[j] = dest[j] - acc[j]
        else:
            for j in range(m):
                dest[j] = acc[j]
    return out
