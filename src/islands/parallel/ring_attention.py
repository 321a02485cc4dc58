"""Ring attention (SOTA-181, LIT-206): attention over a sequence split into one block per rank.

Rank r holds block r of the queries, keys and values. The key/value blocks travel round the ring
(rank r sends to r+1, receives from r-1); at each of the n steps a rank attends its queries to the
block in hand and folds the result into a running softmax (running max, running sum, running
output), so no rank ever holds more than one (block x block) score matrix. The next block's
transfer is started before the current block's compute (Comm.exchange_async), so the link is
hidden whenever one block's transfer is shorter than one block's attention.

Backward makes the same trip: the key/value blocks rotate again, and behind each one travels the
(dK, dV) gathered for it so far; after n hops that gradient is home, complete. Both transfers are
in flight during the next block's compute. Scores are recomputed from the saved log-sum-exp, so
memory stays linear in the local block.

Causal masking uses the natural block order: rank r attends fully to blocks j < r, with the causal
mask to j == r, and skips j > r (those ranks idle for that step; striped layouts even this out and
are not built).
"""

from __future__ import annotations

import math

import torch

from islands.runtime.comm import Comm


def _scores(q, k, scale, causal, q_block, k_block):
    """Scaled scores of local queries against one key block; None if causality hides it entirely."""
    if causal and k_block > q_block:
        return None
    s = (q @ k.transpose(-2, -1)) * scale
    if causal and k_block == q_block:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _rotate(comm: Comm, tensors: list[torch.Tensor], kind: str):
    """Start sending `tensors` (stacked) to the next rank and receiving the previous rank's."""
    n, r = comm.size, comm.rank
    flat = torch.stack(tensors)
    got, wait = comm.exchange_async({(r + 1) % n: flat}, [(r - 1) % n], kind=kind)
    return got[(r - 1) % n], wait


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, causal):
        n, r = comm.size, comm.rank
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = torch.zeros_like(q)
        run_max = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        run_sum = torch.zeros(q.shape[:-1], dtype=q.dtype, device=q.device)
        kv = torch.stack([k, v])
        for step in range(n):
            j = (r - step) % n  # the block in hand came from rank j
            pending = _rotate(comm, list(kv), "ring_kv") if step < n - 1 else None
            s = _scores(q, kv[0], scale, causal, r, j)
            if s is not None:
                new_max = torch.maximum(run_max, s.amax(-1))
                keep = torch.exp(run_max - new_max)  # exp(-inf) = 0 on the first block
                p = torch.exp(s - new_max.unsqueeze(-1))
                run_sum = run_sum * keep + p.sum(-1)
                out = out * keep.unsqueeze(-1) + p @ kv[1]
                run_max = new_max
            if pending is not None:
                got, wait = pending
                wait()
                kv = got
        out = out / run_sum.unsqueeze(-1)
        lse = run_max + torch.log(run_sum)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.causal, ctx.scale = comm, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm, causal, scale = ctx.comm, ctx.causal, ctx.scale
        n, r = comm.size, comm.rank
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        partial = torch.zeros_like(kv)  # (dk, dv) gathered so far for the block in hand
        in_flight = None  # the previous rank's partial for our next block, travelling during this step
        for step in range(n):
            j = (r - step) % n
            next_kv = _rotate(comm, list(kv), "ring_kv") if step < n - 1 else None
            s = _scores(q, kv[0], scale, causal, r, j)
            mine = torch.zeros_like(kv)
            if s is not None:
                p = torch.exp(s - lse.unsqueeze(-1))
                ds = p * (grad_out @ kv[1].transpose(-2, -1) - delta) * scale
                dq = dq + ds @ kv[0]
                mine[0] = ds.transpose(-2, -1) @ q
                mine[1] = p.transpose(-2, -1) @ grad_out
            if in_flight is not None:
                got, wait = in_flight
                wait()
                partial = got
            partial = partial + mine
            # the block's gradient moves on (n hops in all bring it home), overlapping the next step
            in_flight = _rotate(comm, list(partial), "ring_kv_grad") if n > 1 else None
            if next_kv is not None:
                got, wait = next_kv
                wait()
                kv = got
        if in_flight is not None:
            got, wait = in_flight
            wait()
            partial = got
        return dq, partial[0], partial[1], None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, causal: bool = True) -> torch.Tensor:
    """Attention of this rank's query block over the whole sequence, whose blocks are spread over
    `comm`'s ranks in rank order. q, k, v: (..., block, head_dim), the same shape on every rank."""
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"q, k, v must have one shape (..., block, head_dim); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.dim() < 2 or q.shape[-2] == 0:
        raise ValueError(f"need at least one position per rank, shaped (..., block, head_dim); got {tuple(q.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise TypeError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), comm, bool(causal))


def ring_kv_bytes(block_shape: tuple[int, ...], itemsize: int, ranks: int) -> dict[str, int]:
    """Bytes one rank sends per call: forward n-1 hops of (k, v); backward n-1 hops of (k, v) and
    n hops of (dk, dv)."""
    one = math.prod(block_shape) * itemsize
    return {"forward": 2 * one * (ranks - 1), "backward": 2 * one * (2 * ranks - 1) if ranks > 1 else 0}
