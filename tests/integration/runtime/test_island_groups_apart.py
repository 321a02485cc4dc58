"""Island groups made apart from the default group (runtime.world._world_over_default_group's `island_backend`): what
a world of islands sharing GPUs builds, NCCL inside each island over a gloo world (plan_groups). The CPU has no
NCCL, so here the island groups are gloo too, built the same way: each island's group of its own ranks, the cross
groups, and the ("island", "local") mesh made from them. 4 ranks, 2 islands of 2: the groups hold the right ranks,
and DDP inside the islands with DiLoCo across, and FSDP inside them under DiLoCo, train bit for bit as the mesh's
own groups do. The CUDA run of the layout: test_cuda_shared_islands.py."""

from __future__ import annotations

import numpy as np

from harness.world import leave_group, spawn_ranks


def _fit(world, inner: str) -> list:
    import torch
    import torch.nn.functional as F

    import islands

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 12, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    part = islands.inner.FSDP() if inner == "fsdp" else islands.inner.DDP()
    strategy = islands.Stack(inner=part, outer=islands.outer.DiLoCo(inner_steps=3))
    trainer = islands.Trainer(
        model, opt, F.cross_entropy, data, batch_size=4, strategy=strategy, world=world, log_every=10**9
    )
    trainer.fit(7)
    return [t.detach().numpy().copy() for t in trainer.eval_model.state_dict().values()]


def _rank(rank, env, queue):
    import os

    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from islands.runtime.world import _world_over_default_group

    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=4)
    cpu = torch.device("cpu")
    mesh_world = _world_over_default_group(2, cpu, "gloo", "gloo", timeout_s=30)
    apart = _world_over_default_group(2, cpu, "gloo", "gloo", timeout_s=30, island_backend="gloo")
    out = {
        "local_backend": (mesh_world.local_backend, apart.local_backend),
        "local": dist.get_process_group_ranks(apart.local_group),
        "cross": dist.get_process_group_ranks(apart.cross_group),
        "mesh_local": dist.get_process_group_ranks(apart.mesh.get_group("local")),
        "mesh_island": dist.get_process_group_ranks(apart.mesh.get_group("island")),
        "own_groups": apart.mesh.get_group("local") is apart.local_group,
        "staged": apart.crosses_through_host,
    }
    for inner in ("ddp", "fsdp"):
        out[inner] = (_fit(mesh_world, inner), _fit(apart, inner))
    leave_group()
    queue.put((rank, out))


def test_island_groups_made_apart_hold_the_islands_and_train_as_the_meshs_own():
    for rank, out in spawn_ranks(_rank, 4, timeout=240):
        island, slot = rank // 2, rank % 2
        assert out["local_backend"] == ("", "gloo")
        assert out["local"] == out["mesh_local"] == [2 * island, 2 * island + 1]
        assert out["cross"] == out["mesh_island"] == [slot, slot + 2]
        assert out["own_groups"] and not out["staged"]  # CPU tensors: nothing to stage
        for inner in ("ddp", "fsdp"):
            mesh_params, apart_params = out[inner]
            assert len(mesh_params) == len(apart_params) > 0
            assert all(np.array_equal(a, b) for a, b in zip(mesh_params, apart_params)), inner
