"""A Linear layer whose input features are split over the ranks of one island (row parallelism).

Rank r holds columns [r*k/n, (r+1)*k/n) of the weight and receives the matching slice of the input;
each rank's partial product is summed by one all-reduce, which `chunks` > 1 pipelines with the
matmul (SOTA-059). The backward pass needs no communication: the output gradient is already the
same on every rank, so each rank's input and weight gradients are local products.
"""

from __future__ import annotations

import torch
from torch import nn

from islands.parallel.overlap import check_chunks, matmul_all_reduce
from islands.runtime.comm import Comm


class _ReducedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, comm, chunks):
        ctx.save_for_backward(x, weight)
        return matmul_all_reduce(x, weight, comm, chunks)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = (g @ weight).reshape(x.shape)
        grad_w = g.T @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_w, None, None


class RowParallelLinear(nn.Module):
    """y = x @ W.T + b with W's input columns sharded over `comm`'s ranks; x is this rank's slice."""

    def __init__(self, in_features: int, out_features: int, comm: Comm, bias: bool = True, chunks: int = 1):
        super().__init__()
        n = comm.size
        if in_features % n:
            raise ValueError(f"in_features {in_features} must divide evenly over {n} ranks; pick a multiple of {n}")
        self.comm, self.chunks = comm, check_chunks(chunks)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features // n))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None  # added once, after the sum
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Comm, chunks: int = 1) -> RowParallelLinear:
        """This rank's shard of an existing Linear (same result as the whole layer on the whole input)."""
        layer = cls(linear.in_features, linear.out_features, comm, bias=linear.bias is not None, chunks=chunks)
        layer = layer.to(dtype=linear.weight.dtype, device=linear.weight.device)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, layer.input_slice()])
            if linear.bias is not None and layer.bias is not None:  # (the one has a bias when the other does)
                layer.bias.copy_(linear.bias)
        return layer

    def input_slice(self) -> slice:
        width = self.in_features // self.comm.size
        return slice(self.comm.rank * width, (self.comm.rank + 1) * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(
                f"expected this rank's input slice of width {self.weight.shape[1]} "
                f"(in_features {self.in_features} / {self.comm.size} ranks), got {x.shape[-1]}"
            )
        y = _ReducedMatmul.apply(x, self.weight, self.comm, self.chunks)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (shard {self.weight.shape[1]}), out_features={self.out_features}, "
            f"chunks={self.chunks}"
        )
