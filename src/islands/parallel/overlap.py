"""A matmul and the all-reduce of its result, pipelined in chunks (SOTA-059, LIT-735).

Issued back to back, the link idles while the matmul runs and the cores idle while the result
travels. Split the rows into `chunks` pieces: piece i's all-reduce is in flight (gloo/NCCL run it on
their own threads or streams) while piece i+1 is being multiplied, so the two costs overlap and the
step approaches max(compute, comm) instead of their sum. The bytes sent are identical for any chunk
count; only the number of collectives changes (each one pays the link's latency once).
"""

from __future__ import annotations

import torch

from islands.runtime.comm import Comm


def check_chunks(chunks) -> int:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive int (1 = matmul then all-reduce, no overlap), got {chunks!r}")
    return chunks


def matmul_all_reduce(
    x: torch.Tensor, weight: torch.Tensor, comm: Comm, chunks: int = 1, kind: str = "tp_all_reduce"
) -> torch.Tensor:
    """sum over ranks of x @ weight.T, computed as `chunks` row blocks whose all-reduces overlap the
    next block's matmul. x: (..., k) on every rank, weight: (n, k); returns (..., n).

    Every rank must pass the same shapes and chunk count (the collectives pair up in order)."""
    chunks = check_chunks(chunks)
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"shapes do not multiply: x {tuple(x.shape)} @ weight.T with weight {tuple(weight.shape)}; "
            "need x (..., k) and weight (n, k)"
        )
    if x.dtype != weight.dtype:
        raise TypeError(f"x is {x.dtype} but weight is {weight.dtype}; cast one so both match")
    rows = x.reshape(-1, x.shape[-1])
    out_shape = (*x.shape[:-1], weight.shape[0])
    if rows.shape[0] == 0:
        return x.new_zeros(out_shape)  # nothing to send; every rank sees the same empty shape
    pieces = rows.tensor_split(min(chunks, rows.shape[0]))
    outs, pending = [], []
    for piece in pieces:
        y = piece @ weight.T
        pending.append(comm.all_reduce_async(y, kind=kind))
        outs.append(y)
    for fut in pending:
        fut.wait()
    return torch.cat(outs).reshape(out_shape)
