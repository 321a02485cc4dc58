"""Which backend each process group of a fixed world gets, from the facts of the host (runtime.world.plan_groups; issue
#34 item 6): NCCL everywhere when every worker has a GPU, gloo on the CPU, and islands that share GPUs with NCCL only
inside each island and gloo for the default and cross groups. Pure functions of the facts given, so they run here;
the GPU run of the shared layout is tests/integration/runtime/test_cuda_shared_islands.py."""

from __future__ import annotations

import types

import pytest
import torch

from islands.app.validate import device_has_gpus
from islands.config import from_mapping
from islands.runtime.world import GroupPlan, islands_may_share, plan_groups
from islands.sync.shard_group import build_mesh

CPU = torch.device("cpu")


def cuda(i: int) -> torch.device:
    return torch.device("cuda", i)


def plan(device="cuda", cross="auto", islands=2, workers=2, local_workers=None, index=0, gpus=1, links=False):
    local = workers if local_workers is None else local_workers
    return plan_groups(device, cross, islands, workers, local, index, gpus, links)


def test_a_gpu_for_every_worker_keeps_nccl_and_the_cross_backend_asked():
    assert plan("auto", islands=2, workers=2, index=1, gpus=2) == GroupPlan("nccl", "nccl", "nccl", cuda(1))
    assert plan("cuda", "gloo", islands=2, workers=2, gpus=2) == GroupPlan("nccl", "nccl", "gloo", cuda(0))
    assert plan("auto", islands=2, workers=4, index=3, gpus=8, links=True).cross == "gloo"  # a testbed: gloo across
    assert not plan("cuda", islands=1, workers=1, gpus=1).shares_devices


def test_the_cpu_is_gloo_everywhere_and_auto_falls_back_to_it():
    assert plan("cpu", gpus=4) == GroupPlan("gloo", "gloo", "gloo", CPU)
    # auto with more workers than GPUs stays on the CPU: sharing GPUs is asked for with device=cuda
    assert plan("auto", islands=2, workers=2, gpus=1) == GroupPlan("gloo", "gloo", "gloo", CPU)
    with pytest.raises(ValueError, match="cross_backend=nccl needs a CUDA world"):
        plan("cpu", "nccl")


@pytest.mark.parametrize("cross", ["auto", "gloo"])
def test_two_single_worker_islands_share_one_gpu_nccl_inside_gloo_across(cross):
    for index in (0, 1):
        p = plan("cuda", cross, islands=2, workers=2, index=index, gpus=1)
        assert p == GroupPlan(backend="gloo", local="nccl", cross="gloo", device=cuda(0))
        assert p.shares_devices


@pytest.mark.parametrize(("islands", "per_island", "gpus"), [(3, 2, 2), (2, 2, 3), (4, 3, 4), (2, 1, 1), (5, 1, 2)])
def test_an_islands_workers_land_on_different_gpus(islands, per_island, gpus):
    workers = islands * per_island
    devices = [plan("cuda", islands=islands, workers=workers, index=i, gpus=gpus).device for i in range(workers)]
    assert all(d.type == "cuda" and d.index < gpus for d in devices)
    for island in range(islands):
        mine = devices[island * per_island : (island + 1) * per_island]
        assert len(set(mine)) == per_island, (island, mine)  # NCCL refuses two ranks of one group on one GPU


def test_what_cannot_share_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"one GPU per worker.*cross_backend gloo or auto.*cross_backend nccl"):
        plan("cuda", "nccl", islands=2, workers=2, gpus=1)  # NCCL across would put both ranks on the one GPU
    with pytest.raises(ValueError, match=r"one GPU per worker.*2 island\(s\) of 2"):
        plan("cuda", islands=2, workers=4, gpus=1)  # an island of two on one GPU
    with pytest.raises(ValueError, match="one GPU per worker"):
        plan("cuda", islands=1, workers=2, gpus=1)  # one island: nothing to share
    with pytest.raises(ValueError, match=r"0 GPU\(s\) visible; use device=cpu \(gloo\) or at most 0") as e:
        plan("cuda", islands=2, workers=2, gpus=0)
    assert "share" not in str(e.value)
    assert islands_may_share(2, 2, 1) and islands_may_share(2, 4, 2, "gloo")
    assert not islands_may_share(2, 2, 1, "nccl") and not islands_may_share(1, 2, 2) and not islands_may_share(2, 3, 4)


def test_validation_lets_islands_share_a_gpu_and_still_refuses_one_island(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    shared = dict(device="cuda", workers=2, islands=2, outer="diloco:inner_steps=5", global_batch=16)
    assert device_has_gpus(from_mapping(shared)) is None
    assert device_has_gpus(from_mapping({**shared, "cross_backend": "gloo"})) is None
    refused = device_has_gpus(from_mapping({**shared, "cross_backend": "nccl"}))
    assert refused is not None and "one GPU per local worker" in refused and "share the GPUs" in refused
    alone = device_has_gpus(from_mapping({**shared, "islands": 1, "outer": ""}))
    assert alone is not None and "one GPU per local worker" in alone


def test_fsdp_across_islands_that_share_gpus_is_refused():
    world = types.SimpleNamespace(size=2, islands=2, workers_per_island=1, backend="gloo", local_backend="nccl")
    with pytest.raises(ValueError, match=r"islands sharing GPUs.*outer strategy"):
        build_mesh(world, 2)
