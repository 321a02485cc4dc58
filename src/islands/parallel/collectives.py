"""Differentiable row collectives over a counted Comm: each one's backward is the other.

gather_rows: every rank's rows, concatenated in rank order; backward sums the gradient over ranks
and hands each rank its own rows (a reduce-scatter). scatter_rows: the sum over ranks, split so each
rank keeps its rows; backward all-gathers the gradient. Ledger kinds are `<prefix>_all_gather` and
`<prefix>_reduce_scatter`, so each user's bytes stay separate.
"""

from __future__ import annotations

import torch

from islands.runtime.comm import Comm


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, prefix):
        ctx.comm, ctx.prefix = comm, prefix
        return comm.all_gather_cat(t, kind=f"{prefix}_all_gather")

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.reduce_scatter(grad.contiguous(), kind=f"{ctx.prefix}_reduce_scatter"), None, None


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, prefix):
        ctx.comm, ctx.prefix = comm, prefix
        return comm.reduce_scatter(t, kind=f"{prefix}_reduce_scatter")

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_gather_cat(grad, kind=f"{ctx.prefix}_all_gather"), None, None


def gather_rows(t: torch.Tensor, comm: Comm, prefix: str) -> torch.Tensor:
    return _GatherRows.apply(t, comm, prefix)


def scatter_rows(t: torch.Tensor, comm: Comm, prefix: str) -> torch.Tensor:
    return _ScatterRows.apply(t, comm, prefix)
