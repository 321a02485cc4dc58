"""dct-topk's transform. Forward: the matrix product as before, bit for bit, into a vector on 2 MB pages. Inverse, on
the CPU: each block the sum of y_k D[k, :] over k ascending, one fp32 product and one fp32 add at a time from +0, the
same bits from the compiled loop (which skips zero coefficients) and from torch's ops (kernels off); within fp32
rounding of the old matrix product, not its bits. subtract_sent is x - decompress(payload) in place, and error
feedback's residual follows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import islands.compress.base as base
from islands.compress import Agreed, pages, parse_compressor
from islands.compress.dct import DCTTopK, dct_basis


@pytest.fixture(params=[True, False], ids=["kernels", "torch-ops"])
def path(request, monkeypatch):
    monkeypatch.setattr(base, "USE_KERNELS", request.param)
    return request.param


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits (the sign of zero included), NaN where the other has a NaN: which NaN an add of two NaNs or of
    Inf and -Inf gives depends on its operands' order, which a compiler may swap."""
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    keep = ~a.isnan()
    return torch.equal(a[keep].view(torch.int32), b[keep].view(torch.int32))


def old_forward(c: DCTTopK, x: torch.Tensor) -> torch.Tensor:
    padded = c.coeff_count(x.numel())
    if padded != x.numel():
        x = torch.cat([x, x.new_zeros(padded - x.numel())])
    return (x.view(-1, c.block) @ dct_basis(c.block).T).reshape(-1)


def old_inverse(c: DCTTopK, y: torch.Tensor, numel: int) -> torch.Tensor:
    return (y.view(-1, c.block) @ dct_basis(c.block)).reshape(-1)[:numel]


def ref_inverse(c: DCTTopK, y: torch.Tensor, numel: int) -> torch.Tensor:
    """The documented sums with numpy's fp32 ops: acc = +0, then acc = fp32(acc + fp32(y_k * D[k])) for each k."""
    rows = y.numpy().reshape(-1, c.block)
    basis = dct_basis(c.block).numpy()
    acc = np.zeros(rows.shape, np.float32)
    for k in range(c.block):
        with np.errstate(invalid="ignore"):  # Inf - Inf: NaN, as fp32 has it
            acc = (acc + rows[:, k : k + 1] * basis[k]).astype(np.float32)
    return torch.from_numpy(acc.reshape(-1)[:numel].copy())


def _coefficients(n: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    y = torch.randn(n, generator=g)
    if kind == "sparse":
        y[torch.rand(n, generator=g) > 0.03] = 0.0
    elif kind == "signed-zeros":  # -0 and +0 coefficients, a block of nothing else, and exact cancellation
        y[torch.rand(n, generator=g) > 0.5] = -0.0
        y[: min(n, 64)] = -0.0
    elif kind == "non-finite":
        y[::37] = float("nan")
        y[5::41] = float("inf")
        y[7::43] = float("-inf")
    return y


@pytest.mark.parametrize("block", [1, 7, 64])
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 4097, pages.MIN_BYTES // 4 + 64])
def test_forward_is_the_matrix_product_and_inverts_it(path, block, n):
    c = DCTTopK(block=block)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    y = c.forward(x)
    assert _same(y, old_forward(c, x))
    back = c.inverse(y, n)
    assert back.shape == (n,) and _same(back, ref_inverse(c, y, n))
    if n:  # orthonormal: the inverse gives x back to fp32 rounding, as the old matrix product did
        tol = 4e-7 * math.sqrt(block) * float(x.abs().max())
        assert float((back - x).abs().max()) < tol
        assert float((back - old_inverse(c, y, n)).abs().max()) < tol


@pytest.mark.parametrize("block", [1, 7, 64])
@pytest.mark.parametrize("kind", ["dense", "sparse", "signed-zeros", "non-finite"])
@pytest.mark.parametrize("n", [1, 64, 3 * 64 + 5, 70_000])
def test_inverse_is_the_documented_sum_on_either_path(path, block, kind, n):
    c = DCTTopK(block=block)
    y = _coefficients(c.coeff_count(n), kind)
    got = c.inverse(y, n)
    assert _same(got, ref_inverse(c, y, n))


@pytest.mark.parametrize("n", [5, 4096 + 3, 3 * 4096 + 64])
def test_subtract_sent_in_place_is_x_minus_the_decode(path, n):
    c = DCTTopK(ratio=0.0215, bits=2)
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    p = c.compress(x, {})
    want = x - c.decompress(p)
    assert _same(want, x - ref_inverse(c, c.sum_gathered([p]), n))
    work = x.clone()
    got = c.subtract_sent(work, p)
    assert got is work and _same(got, want)
    half = x.to(torch.bfloat16)  # decompress rounds to bf16: torch's ops, x left as it was
    p = c.compress(half, {})
    x32 = half.float()
    before = x32.clone()
    got = c.subtract_sent(x32, p)
    assert _same(got, before - c.decompress(p).float()) and _same(x32, before)


def test_error_feedback_residual_and_decode_follow_the_documented_inverse(path):
    ef = parse_compressor("dct-topk:ratio=0.0215,bits=2")
    n = 2 * 4096 + 100
    residual = torch.zeros(n)
    g = torch.Generator().manual_seed(4)
    st = ef.state("w", residual)
    for _ in range(3):
        delta = torch.randn(n, generator=g)
        x = residual + delta
        p = ef.compress(delta, st, Agreed(ef.agree(delta, st), 1))
        assert _same(p.tensors[0], ef.inner.compress(x, {}).tensors[0])  # the payload comes from the old forward
        coeffs = ef.inner.sum_gathered([p])
        residual = x - ref_inverse(ef.inner, coeffs, n)
        assert _same(st["residual"], residual)
        assert _same(ef.combine_gathered([p]), ref_inverse(ef.inner, coeffs, n))
        q = ef.inner.compress(-delta, {})  # two ranks: the mean of the coefficients, then the inverse
        both = ef.inner.sum_gathered([p, q]) / 2
        assert _same(ef.combine_gathered([p, q]), ref_inverse(ef.inner, both, n))
