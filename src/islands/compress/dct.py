"""DCT-domain top-k: DeMo's idea (a chunked discrete cosine transform, then the largest coefficients).

DeMo (LIT-905, SOTA-903; Peng, Quesnelle, Kingma 2024) transforms chunks of what it sends with a DCT and
keeps the top-k coefficients of each chunk (its defaults: chunks of 64, 32 coefficients kept), on the
view that the useful, fast-moving part of an update concentrates in a few frequencies. Ours, on a flat
tensor: cut it into blocks of `block` values (64; the last one zero-padded), transform each block with the
orthonormal DCT-II, then select and quantise the coefficient vector exactly as TopKQ does (top `ratio` of
each chunk of `chunk` coefficients, positions packed, values as `bits`-bit codes with a least-squares
scale per chunk). Decoding scatters the coefficients and applies the inverse (DCT-III, the transpose).

The transform is one matmul with a cached basis per (block, device): D[k, j] = a_k cos(pi (j + 1/2) k / B),
a_0 = sqrt(1/B), a_k = sqrt(2/B). D is orthonormal (D D^T = I to fp32 rounding), so a coefficient error has
the same norm as the error it makes in the tensor: TopKQ's contraction carries over (the padded tail
only drops error), and error feedback applies unchanged.

Bytes per tensor of n values: TopKQ's formula on ceil(n / block) * block coefficients. Ranks' payloads
are all-gathered and summed in the coefficient domain (exactly TopKQ's sparse sum), then transformed back
once: the mean equals the mean of the decoded payloads to fp32 rounding (the inverse is linear).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from islands.compress import pages
from islands.compress.base import Payload, cpu_kernels, numel_of
from islands.compress.topkq import SPARSELOCO_CHUNK, TopKQ

# DeMo's chunk length (its `compression_chunk` default)
DEMO_BLOCK = 64

_BASES: dict[tuple[int, str], Tensor] = {}


def dct_basis(block: int, device: torch.device | str = "cpu") -> Tensor:
    """The orthonormal DCT-II matrix (block x block, fp32): y = D x transforms, x = D^T y inverts (DCT-III)."""
    key = (int(block), str(device))
    basis = _BASES.get(key)
    if basis is None:
        j = torch.arange(block, dtype=torch.float64)
        k = j.view(-1, 1)
        basis = torch.cos(math.pi * (j + 0.5) * k / block) * math.sqrt(2.0 / block)
        basis[0] = math.sqrt(1.0 / block)
        basis = basis.to(device=device, dtype=torch.float32)
        _BASES[key] = basis
    return basis


class DCTTopK(TopKQ):
    name = "dct-topk"
    sparse_in_place = False  # the residual lives in the tensor's domain, the payload in the DCT's

    def __init__(
        self,
        ratio: float = 0.01,
        bits: Literal[2, 4, 8, 32] = 2,
        block: int = DEMO_BLOCK,
        chunk: int = SPARSELOCO_CHUNK,
        decay: float = 1.0,
        ef: bool = True,
        index: Literal["fixed", "elias-fano"] = "fixed",
        order: Literal["ascending", "torch"] = "ascending",
    ):
        """DeMo's transform, then TopKQ on the DCT coefficients. `ratio`: fraction of each chunk of coefficients sent.
        `bits`: value codes of 2, 4 or 8 bits with one fp32 scale per chunk, or 32 for fp32 values. `block`: DCT length
        (DeMo: 64). `chunk`: coefficients per top-k chunk (4096: a position packs into 12 bits). `decay`: the
        error-feedback residual's weight each round (1 = plain error feedback). `ef`: error feedback around it. `index`:
        how positions travel, fixed (ceil(log2 chunk) bits each) or elias-fano (topkq's). `order`: topkq's, a chunk's
        positions ascending (default) or in torch.topk's order (torch)."""
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"{self.name} block (DCT length) must be an int >= 1, got {block!r}")
        super().__init__(ratio=ratio, bits=bits, chunk=chunk, decay=decay, ef=ef, index=index, order=order)
        self.block = int(block)

    def coeff_count(self, numel: int) -> int:
        return -(-numel // self.block) * self.block

    def forward(self, x: Tensor) -> Tensor:
        n = x.numel()
        padded = self.coeff_count(n)
        if padded != n:
            x = torch.cat([x, x.new_zeros(padded - n)])
        return self._product(x, dct_basis(self.block, x.device).T)

    def inverse(self, y: Tensor, numel: int) -> Tensor:
        """The first `numel` values of y's blocks times D (DCT-III). On the CPU each block is the sum of y_k D[k, :],
        k ascending, a product and an add at a time from +0 (kernels_dct, which skips the zero coefficients of a
        sparse decode; torch's ops where the kernels are off, the same bits); elsewhere one matrix product."""
        basis = dct_basis(self.block, y.device)
        if y.device.type != "cpu":
            return self._product(y, basis)[:numel]
        kernels = cpu_kernels(y, "kernels_dct")
        if kernels is None:
            return self._sequential(y, basis)[:numel]
        out = pages.empty(numel)
        kernels.block_inverse(y.contiguous().numpy(), basis.numpy(), out.numpy(), False)
        return out

    def _product(self, v: Tensor, basis: Tensor) -> Tensor:
        """v's blocks (rows of `block` values) times `basis`, flat: the same matrix product as `@` (torch.mm, out=
        runs the same kernel), into a vector on 2 MB pages, since a fresh model-sized result's page faults cost
        most of what the product does (100M values, one thread: 0.32 s against 0.18 s)."""
        out = pages.empty(v.numel(), device=v.device)
        torch.mm(v.view(-1, self.block), basis, out=out.view(-1, self.block))
        return out

    def _sequential(self, y: Tensor, basis: Tensor) -> Tensor:
        """kernels_dct.block_inverse's sums with torch's ops: for each k, y[:, k] D[k, :] (one rounding), then added
        (another) to the blocks, which start at +0. One pass per coefficient of a block: the path for when the compiled
        loops are off."""
        rows = y.reshape(-1, self.block)
        out = pages.zeros(y.numel(), device=y.device).view(-1, self.block)
        term = torch.empty_like(out)
        for k in range(self.block):
            torch.mul(rows[:, k : k + 1], basis[k], out=term)
            out.add_(term)
        return out.view(-1)

    def subtract_sent(self, x: Tensor, payload: Payload) -> Tensor:
        """x - decompress(payload), in place in x (the payload never shares x's memory); on the CPU the inverse's pass
        subtracts each block as it forms it, with no decoded vector. Where decompress rounds to a narrower dtype, or x
        is not contiguous, torch's ops as before."""
        if payload.dtype != torch.float32 or not x.is_contiguous():
            return super().subtract_sent(x, payload)
        kernels = cpu_kernels(x, "kernels_dct")
        if kernels is None or payload.tensors[0].device.type != "cpu":
            return x.sub_(self.decompress(payload).view(x.shape))
        y = self._decode_into([payload], self.coeff_count(numel_of(payload.shape)), add=False)
        kernels.block_inverse(y.numpy(), dct_basis(self.block).numpy(), x.view(-1).numpy(), True)
        return x
