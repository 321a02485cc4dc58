"""Contrastive pair losses across ranks: per-pair sigmoid on a ring vs softmax over a gathered batch.

Each rank holds B_r matching pairs (x_i, y_i) as embeddings. The softmax (InfoNCE / CLIP) loss
normalises each row over every column of the global batch, so it gathers all embeddings to every
rank and holds a B_r x B similarity block. The sigmoid loss (SOTA-376, LIT-605) scores each pair on
its own — log sigmoid(t <x_i, y_j> + b) with label +1 for i = j, -1 otherwise — so a rank only ever
needs one block of columns at a time: the y blocks travel round the ring (r sends to r+1), the next
block's transfer overlapping the current block's arithmetic, and in backward each block's gradient
travels behind it until it is home (the same trip as ring attention's keys and values).

Both losses are normalised per rank's rows (sum over the rank's pairs / B_r), so under DDP, which
averages gradients over ranks, the result is the gradient of the global mean loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from islands.parallel.collectives import gather_rows
from islands.runtime.comm import Comm


def _block(x, y, scale, bias, diagonal: bool):
    """Sigmoid loss terms of one (rows x columns) block and dLoss/dlogits."""
    z = scale * (x @ y.T) + bias
    labels = -torch.ones_like(z)
    if diagonal:
        labels.fill_diagonal_(1.0)
    loss = -F.logsigmoid(labels * z).sum()
    dz = -labels * torch.sigmoid(-labels * z)
    return loss, dz


def _rotate(comm: Comm, t: torch.Tensor, kind: str):
    n, r = comm.size, comm.rank
    got, wait = comm.exchange_async({(r + 1) % n: t}, [(r - 1) % n], kind=kind)
    return got[(r - 1) % n], wait


class _RingSigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, log_scale, bias, comm):
        n = comm.size
        scale = log_scale.exp()
        total = x.new_zeros(())
        held = y
        for step in range(n):
            pending = _rotate(comm, held, "pair_ring_y") if step < n - 1 else None
            loss, _ = _block(x, held, scale, bias, diagonal=step == 0)
            total = total + loss
            if pending is not None:
                got, wait = pending
                wait()
                held = got
        ctx.save_for_backward(x, y, log_scale, bias)
        ctx.comm = comm
        return total / x.shape[0]

    @staticmethod
    def backward(ctx, grad):
        x, y, log_scale, bias = ctx.saved_tensors
        comm, n = ctx.comm, ctx.comm.size
        scale = log_scale.exp()
        g = grad / x.shape[0]
        dx, dscale, dbias = torch.zeros_like(x), x.new_zeros(()), x.new_zeros(())
        held, partial, in_flight = y, torch.zeros_like(y), None
        for step in range(n):
            next_y = _rotate(comm, held, "pair_ring_y") if step < n - 1 else None
            _, dz = _block(x, held, scale, bias, diagonal=step == 0)
            dz = dz * g
            dx += scale * (dz @ held)
            mine = scale * (dz.T @ x)
            dscale += (dz * (x @ held.T)).sum()
            dbias += dz.sum()
            if in_flight is not None:
                got, wait = in_flight
                wait()
                partial = got
            partial = partial + mine
            in_flight = _rotate(comm, partial, "pair_ring_y_grad") if n > 1 else None
            if next_y is not None:
                got, wait = next_y
                wait()
                held = got
        if in_flight is not None:
            got, wait = in_flight
            wait()
            partial = got
        # scale = exp(log_scale); t and b are replicated, so each rank returns its rows' share
        return dx, partial, dscale * scale, dbias, None


def _check(x: torch.Tensor, y: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape != y.shape or x.shape[0] == 0:
        raise ValueError(
            f"x and y must be matching (pairs, dim) embeddings with at least one pair; "
            f"got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    if x.dtype != y.dtype or not x.is_floating_point():
        raise TypeError(f"x and y must share one floating dtype; got {x.dtype} and {y.dtype}")


def sigmoid_pair_loss(
    x: torch.Tensor, y: torch.Tensor, log_scale: torch.Tensor, bias: torch.Tensor, comm: Comm | None = None
) -> torch.Tensor:
    """Per-pair sigmoid loss of this rank's rows against every rank's y (SOTA-376); comm=None: one
    process, the whole batch local. Every rank must hold the same number of pairs."""
    _check(x, y)
    if comm is None or comm.size == 1:
        loss, _ = _block(x, y, log_scale.exp(), bias, diagonal=True)
        return loss / x.shape[0]
    return _RingSigmoid.apply(x.contiguous(), y.contiguous(), log_scale, bias, comm)


def softmax_pair_loss(
    x: torch.Tensor, y: torch.Tensor, log_scale: torch.Tensor, comm: Comm | None = None
) -> torch.Tensor:
    """Symmetric softmax (InfoNCE) loss of this rank's pairs, normalised over the global batch: both
    embedding sets are all-gathered so every row and every column sees the whole batch."""
    _check(x, y)
    if comm is None or comm.size == 1:
        xs, ys, offset = x, y, 0
    else:
        xs, ys, offset = gather_rows(x, comm, "pair"), gather_rows(y, comm, "pair"), comm.rank * x.shape[0]
    scale = log_scale.exp()
    target = torch.arange(offset, offset + x.shape[0], device=x.device)
    rows = F.cross_entropy(scale * x @ ys.T, target, reduction="sum")
    cols = F.cross_entropy(scale * y @ xs.T, target, reduction="sum")
    return (rows + cols) / (2 * x.shape[0])
