"""CUDA tensors across a gloo group through page-locked host buffers (islands.runtime.staging; issue #34 item 3),
skipped without a GPU. Two rank processes share one device (gloo does not mind, where NCCL refuses two ranks on
one GPU): every collective an outer strategy uses, on CUDA tensors, against the values it must give."""

from __future__ import annotations

import pytest
import torch

from harness.world import spawn_ranks

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _rank(rank, env, queue):
    import os

    os.environ.update(env, RANK=str(rank))
    import torch
    import torch.distributed as dist

    from islands.runtime.comm import Comm
    from islands.runtime.staging import StagedComm

    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=2)
    dev = torch.device("cuda", 0)
    comm = StagedComm(Comm(None))
    out = {}
    t = torch.full((3, 4), float(rank + 1), device=dev)
    comm.all_reduce(t)
    out["all_reduce"] = (t.device.type, t.sum().item())  # (1 + 2) * 12
    parts = comm.all_gather(torch.full((5,), float(rank), device=dev))
    out["all_gather"] = [(p.device.type, p.tolist()) for p in parts]
    a = torch.full((1000,), float(rank + 1), device=dev)
    fut = comm.all_reduce_async(a)
    b = torch.full((1000,), 10.0 * (rank + 1), device=dev)
    comm.all_reduce(b)  # a second exchange while the first is in flight: its own buffer
    fut.wait()
    torch.cuda.synchronize()
    out["async"] = (a[0].item(), b[0].item())
    c = torch.full((7,), float(rank), device=dev)
    comm.broadcast(c, src=1)
    out["broadcast"] = c.tolist()
    got = comm.exchange({1 - rank: torch.arange(4.0, device=dev) + 100 * rank}, [1 - rank])
    out["exchange"] = (got[1 - rank].device.type, got[1 - rank].tolist())
    held = comm.buffers.take(torch.zeros(3, device=dev))
    out["pinned"] = held.is_pinned()
    dist.destroy_process_group()
    queue.put((rank, out))


def test_cuda_tensors_cross_a_gloo_group_through_pinned_buffers():
    for rank, out in spawn_ranks(_rank, 2, timeout=120):
        assert out["all_reduce"] == ("cuda", 36.0)
        assert out["all_gather"] == [("cuda", [0.0] * 5), ("cuda", [1.0] * 5)]
        assert out["async"] == (3.0, 30.0)
        assert out["broadcast"] == [1.0] * 7
        assert out["exchange"] == ("cuda", [v + 100 * (1 - rank) for v in range(4)])
        assert out["pinned"]
