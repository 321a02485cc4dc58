"""A tensor-parallel MLP block, with or without sequence parallelism (SOTA-058, LIT-736).

The block is x + dropout(W2 gelu(W1 layernorm(x))). Tensor parallelism splits W1 by output
features (column parallel) and W2 by input features (row parallel) over the ranks of one island;
each rank's W2 product is a partial sum.

- Without sequence parallelism the block's input and output are the whole sequence on every rank:
  the layer norm, the dropout and the residual are computed (and their activations held) n times
  over, and the partial sums meet in one all-reduce (its backward twin all-reduces the input
  gradient).
- With sequence parallelism each rank holds 1/n of the positions outside the matmuls. An all-gather
  along the sequence enters the tensor-parallel region and a reduce-scatter leaves it, so the norm,
  dropout and residual run on S/n positions and hold 1/n of their activations. All-gather plus
  reduce-scatter moves the same bytes as the all-reduce it replaces.

The sequence is dim 0 of x (positions, features); batch can be folded into it by the caller.
"""

from __future__ import annotations

import torch
from torch import nn

from islands.parallel.collectives import gather_rows, scatter_rows
from islands.runtime.comm import Comm


class _AllReduceForward(torch.autograd.Function):
    """Forward: sum the partial products. Backward: the gradient is already whole on every rank."""

    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce(x.clone(), kind="tp_all_reduce")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceBackward(torch.autograd.Function):
    """Forward: identity into the column-parallel matmul. Backward: sum the input-gradient parts."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce(grad.clone(), kind="tp_all_reduce"), None


class TensorParallelMLP(nn.Module):
    """This rank's shard of a pre-norm MLP block; `sequence_parallel` chooses how x is laid out."""

    def __init__(self, d_model: int, hidden: int, comm: Comm, sequence_parallel: bool = False, dropout: float = 0.0):
        super().__init__()
        n = comm.size
        if hidden % n:
            raise ValueError(
                f"hidden {hidden} must divide evenly over {n} tensor-parallel ranks; pick a multiple of {n}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.comm, self.sequence_parallel = comm, bool(sequence_parallel)
        self.norm = nn.LayerNorm(d_model)
        self.up = nn.Linear(d_model, hidden // n)  # column parallel: this rank's output features
        self.down = nn.Linear(hidden // n, d_model, bias=False)  # row parallel: partial sums
        self.down_bias = nn.Parameter(torch.zeros(d_model))  # added once, after the sum
        self.drop = nn.Dropout(dropout)

    @classmethod
    def from_full(
        cls,
        norm: nn.LayerNorm,
        up: nn.Linear,
        down: nn.Linear,
        comm: Comm,
        sequence_parallel: bool = False,
        dropout: float = 0.0,
    ) -> TensorParallelMLP:
        """This rank's shard of an unsplit block (norm, up: d->h, down: h->d)."""
        block = cls(up.in_features, up.out_features, comm, sequence_parallel, dropout)
        block = block.to(dtype=up.weight.dtype)
        width = up.out_features // comm.size
        rows = slice(comm.rank * width, (comm.rank + 1) * width)
        with torch.no_grad():
            block.norm.load_state_dict(norm.state_dict())
            block.up.weight.copy_(up.weight[rows])
            block.up.bias.copy_(up.bias[rows])
            block.down.weight.copy_(down.weight[:, rows])
            block.down_bias.copy_(down.bias)
        return block

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters every rank holds whole (norm, output bias)."""
        return [*self.norm.parameters(), self.down_bias]

    def reduce_replicated_grads(self) -> None:
        """With sequence parallelism each rank saw 1/n of the positions, so the replicated parameters'
        gradients are partial: sum them (3 x d_model values). Without it they are already whole."""
        if not self.sequence_parallel:
            return
        for p in self.replicated_parameters():
            if p.grad is not None:
                self.comm.all_reduce(p.grad, kind="sp_grad_all_reduce")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (positions, d_model) — the whole sequence, or this rank's 1/n of it with sequence_parallel."""
        h = self.norm(x)
        h = gather_rows(h, self.comm, "sp") if self.sequence_parallel else _AllReduceBackward.apply(h, self.comm)
        h = self.down(torch.nn.functional.gelu(self.up(h)))
        h = scatter_rows(h, self.comm, "sp") if self.sequence_parallel else _AllReduceForward.apply(h, self.comm)
        return x + self.drop(h + self.down_bias)


def sequence_shard(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """This rank's contiguous 1/n of the positions (dim 0)."""
    n = comm.size
    if x.shape[0] % n:
        raise ValueError(f"sequence length {x.shape[0]} must divide evenly over {n} ranks")
    width = x.shape[0] // n
    return x[comm.rank * width : (comm.rank + 1) * width]
