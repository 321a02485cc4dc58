"""dct-topk's transform into vectors on 2 MB pages (torch.mm with out=) and its in-place subtract_sent give, bit for
bit, what the matrix products and x - decompress(payload) gave before: the coefficients, the decoded tensor and error
feedback's residual."""

from __future__ import annotations

import math

import pytest
import torch

from islands.compress import Agreed, pages, parse_compressor
from islands.compress.dct import DCTTopK, dct_basis


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def old_forward(c: DCTTopK, x: torch.Tensor) -> torch.Tensor:
    padded = c.coeff_count(x.numel())
    if padded != x.numel():
        x = torch.cat([x, x.new_zeros(padded - x.numel())])
    return (x.view(-1, c.block) @ dct_basis(c.block).T).reshape(-1)


def old_inverse(c: DCTTopK, y: torch.Tensor, numel: int) -> torch.Tensor:
    return (y.view(-1, c.block) @ dct_basis(c.block)).reshape(-1)[:numel]


@pytest.mark.parametrize("block", [1, 7, 64])
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 4097, 3 * 4096 + 5, pages.MIN_BYTES // 4 + 64])
def test_forward_and_inverse_are_the_matrix_products(block, n):
    c = DCTTopK(block=block)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    y = c.forward(x)
    assert _same(y, old_forward(c, x))
    assert _same(c.inverse(y, n), old_inverse(c, y, n))
    if n:  # orthonormal: the inverse gives x back to fp32 rounding
        assert float((c.inverse(y, n) - x).abs().max()) < 1e-5 * math.sqrt(block) * float(x.abs().max())


@pytest.mark.parametrize("n", [5, 4096 + 3, 3 * 4096 + 64])
def test_subtract_sent_in_place_is_x_minus_the_decode(n):
    c = DCTTopK(ratio=0.0215, bits=2)
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    p = c.compress(x, {})
    want = x - c.decompress(p)
    work = x.clone()
    got = c.subtract_sent(work, p)
    assert got is work and _same(got, want)
    half = x.to(torch.bfloat16)  # decompress rounds to bf16: torch's ops, x left as it was
    p = c.compress(half, {})
    x32 = half.float()
    before = x32.clone()
    got = c.subtract_sent(x32, p)
    assert _same(got, before - c.decompress(p).float()) and _same(x32, before)


def test_error_feedback_residual_is_x_minus_the_old_decode():
    ef = parse_compressor("dct-topk:ratio=0.0215,bits=2")
    n = 2 * 4096 + 100
    residual = torch.zeros(n)
    g = torch.Generator().manual_seed(4)
    st = ef.state("w", residual)
    for _ in range(3):
        delta = torch.randn(n, generator=g)
        x = residual + delta
        p = ef.compress(delta, st, Agreed(ef.agree(delta, st), 1))
        coeffs = ef.inner.sum_gathered([p])
        residual = x - old_inverse(ef.inner, coeffs, n)
        assert _same(st["residual"], residual)
        assert _same(ef.combine_gathered([p]), old_inverse(ef.inner, coeffs, n))
