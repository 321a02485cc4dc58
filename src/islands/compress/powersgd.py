"""PowerSGD (LIT-337): rank-r approximation by one warm-started power-iteration step, all-reducible.

For a gradient viewed as an n x m matrix M (first dim by the rest), with Q (m x r) kept per
parameter name and identical on every rank:
    agree:     P = M Q                  all-reduced (sum)        -> n*r fp32
    compress:  P^ = orthonormal(P);  Q = M^T P^                   -> m*r fp32, summed by the caller
    decode:    P^ (sum Q)^T  / ranks;  the averaged Q warm-starts the next step (`absorb`).
Tensors with one dimension (biases, norms), and matrices where (n+m) r >= n m, travel uncompressed:
the factors would cost more than the values. Pair it with ErrorFeedback: rank 4 without it does
not converge (SOTA-214).
"""

from __future__ import annotations

import torch
from torch import Tensor

from islands.compress.base import (
    Agreed,
    Combine,
    CompressorBase,
    Payload,
    as_fp32,
    name_seed,
    nbytes_of,
    numel_of,
)


class PowerSGD(CompressorBase):
    name = "powersgd"
    combine = Combine.SUMMABLE
    agree_op = "sum"

    def __init__(self, rank: int = 4, seed: int = 0):
        super().__init__()
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"powersgd rank must be an int >= 1, got {rank!r}")
        self.rank = rank
        self.seed = int(seed)  # same on every rank: Q must start identical everywhere

    def matrix(self, shape) -> tuple[int, int, int] | None:
        """(n, m, r) when the tensor is worth factorising, else None (sent as is)."""
        if len(shape) < 2:
            return None
        n = int(shape[0])
        m = numel_of(shape) // n if n else 0
        r = min(self.rank, n, m)
        if r == 0 or (n + m) * r >= n * m:
            return None
        return n, m, r

    def init_state(self, name: str, tensor: Tensor) -> dict:
        dims = self.matrix(tensor.shape)
        if dims is None:
            return {}
        _, m, r = dims
        g = torch.Generator().manual_seed(name_seed(self.seed, name))
        return {"Q": torch.randn(m, r, generator=g).to(tensor.device)}

    def agree(self, tensor: Tensor, state: dict) -> list[Tensor]:
        dims = self.matrix(tensor.shape)
        if dims is None:
            return []
        n, m, _ = dims
        return [as_fp32(tensor).reshape(n, m) @ state["Q"]]

    def compress(self, tensor: Tensor, state: dict, agreed: Agreed | None = None) -> Payload:
        dims = self.matrix(tensor.shape)
        if dims is None:
            return Payload([tensor.detach().contiguous().reshape(-1)], tensor.shape, tensor.dtype)
        n, m, r = dims
        M = as_fp32(tensor).reshape(n, m)
        P = agreed.tensors[0] if agreed is not None else M @ state["Q"]
        # QR gives the same orthonormal basis on every rank because every rank holds the same P sum.
        P_hat = torch.linalg.qr(P, mode="reduced").Q.contiguous()
        Q = (M.t() @ P_hat).contiguous()
        state["Q"] = Q.clone()  # replaced by the average in `absorb` when other ranks take part
        return Payload([Q], tensor.shape, tensor.dtype, shared=[P_hat], agreed_nbytes=n * r * 4)

    def decompress(self, payload: Payload) -> Tensor:
        if not payload.shared:
            return payload.tensors[0].reshape(payload.shape).to(payload.dtype)
        return (payload.shared[0] @ payload.tensors[0].t()).reshape(payload.shape).to(payload.dtype)

    def absorb(self, state: dict, summed: Payload) -> None:
        if summed.shared:
            state["Q"] = summed.tensors[0] / summed.summands

    def payload_nbytes(self, shape, dtype) -> int:
        dims = self.matrix(shape)
        if dims is None:
            return nbytes_of(numel_of(shape), dtype)
        n, m, r = dims
        return (n + m) * r * 4
