"""world.cross_backend (issue #34 item 3): the cross-island group on a backend of its own, and device tensors
staged through host buffers on their way across (islands.runtime.staging).

On the CPU every group is gloo, so what runs here is the GPU path's construction and its staging with the one
thing a CPU cannot do replaced: `cross_backend="gloo"` builds the groups the way a NCCL world builds its gloo
ones (one new group per slot, not the mesh's), and `stages_across`/`needs_staging` are switched on in the rank
processes so every tensor an outer strategy exchanges goes through a host buffer and back, as a CUDA tensor
would. Both must leave the numbers alone: the same global model bit for bit, the same bytes, as the mesh's group
without staging. 4 gloo ranks, 2 islands of 2 (each slot its own cross group).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from test_outer_dist import Run, _scenario

from harness.outer import run_world

SPECS = {
    "diloco": ("diloco:inner_steps=3", 7),  # all_reduce
    "streaming": ("streaming-diloco:inner_steps=4,fragments=2,tau=1,bits=4,block=16", 9),
    "median": ("diloco:inner_steps=2,aggregate=median", 4),  # all_gather
    "topkq": ("diloco:inner_steps=3,compressor=(topkq:ratio=0.02,bits=2,chunk=256)", 6),  # sparse payloads gathered
}


def _stage_everything() -> None:
    """In a rank process: the staging a CUDA world over a gloo cross group gets, for CPU tensors too."""
    import islands.runtime.staging as staging
    import islands.runtime.world as world_mod

    world_mod.stages_across = lambda device, cross: True
    staging.needs_staging = lambda tensor: True


def _groups(world) -> dict:
    import torch
    import torch.distributed as dist

    comm = world.comm("cross")
    t = torch.tensor([float(world.rank)])
    comm.all_reduce(t)
    return {
        "cross_backend": world.cross_backend,
        "ranks": dist.get_process_group_ranks(world.cross_group),
        "mesh_group": world.cross_group is world.mesh.get_group("island"),
        "sum": float(t.item()),
    }


def _p2p(world) -> list:
    import torch

    comm = world.comm("cross")
    peer = 1 - comm.rank
    mine = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * world.rank
    got = comm.exchange({peer: mine}, [peer], like=mine, kind="p2p")
    return [list(got[peer].shape), got[peer].flatten().tolist()]


def _batchnorm_cnn(world) -> list:
    """A BatchNorm CNN of the test's own through islands.Trainer with DiLoCo (a model islands did not write): the
    global model's parameters and running statistics, which cross as the outer delta and the buffers' average."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import islands

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)
    )
    g = torch.Generator().manual_seed(10 + world.rank)
    x = torch.randn(32, 1, 6, 6, generator=g) * (1 + world.rank)  # islands see different statistics
    data = torch.utils.data.TensorDataset(x, torch.randint(0, 3, (32,), generator=g))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    strategy = islands.Stack(outer=islands.outer.DiLoCo(inner_steps=2))
    trainer = islands.Trainer(
        model, opt, F.cross_entropy, data, batch_size=8, strategy=strategy, world=world, log_every=10**9
    )
    trainer.fit(4)
    return [t.detach().numpy().copy() for t in trainer.eval_model.state_dict().values()]


def _train(world, staged: bool) -> dict:
    import torch

    from islands.measure.probe import probe_interconnect
    from islands.runtime.staging import StagedComm

    if staged:
        _stage_everything()
    out = {"groups": _groups(world), "p2p": _p2p(world)}
    probe = probe_interconnect(world)
    out["probe"] = {"cross_backend": probe["cross_backend"], "cross": probe.get("cross")}
    torch.manual_seed(world.rank)
    out.update({name: _scenario(world, *args) for name, args in SPECS.items()})
    out["bn"] = _batchnorm_cnn(world)
    comm = world.comm("cross")
    out["staged_comm"] = isinstance(comm, StagedComm)
    out["buffers"] = comm.buffers.allocated if isinstance(comm, StagedComm) else 0
    # authenticated payloads: the tags hash host bytes, so the staging goes around the authenticating Comm
    from islands.runtime.payload_auth import AuthenticatedComm, authenticate_payloads

    authenticate_payloads(world, token="cross-backend-test")
    comm = world.comm("cross")
    out["auth_order"] = [type(comm).__name__, type(getattr(comm, "inner", comm)).__name__]
    torch.manual_seed(world.rank)
    run = Run(world, SPECS["diloco"][0])
    for i in range(SPECS["diloco"][1]):
        run.step(i)
    run.finish()
    out["authenticated"] = {"global": run.global_np(), "local": run.local_np(), "rounds": run.strategy.rounds}
    assert isinstance(world.host_comm("cross"), AuthenticatedComm)
    return out


@pytest.fixture(scope="module")
def runs():
    """(the mesh's cross group, unstaged; gloo groups of their own, every tensor staged through host buffers)"""
    plain = run_world(functools.partial(_train, staged=False), 4, 2)
    staged = run_world(functools.partial(_train, staged=True), 4, 2, init={"cross_backend": "gloo"})
    return plain, staged


def test_each_slot_meets_its_peers_on_every_island(runs):
    for cross, run in zip(["auto", "gloo"], runs):
        for rank, r in enumerate(run):
            g, slot = r["groups"], rank % 2
            assert g["cross_backend"] == "gloo"
            assert g["ranks"] == [slot, slot + 2]
            assert g["sum"] == slot + slot + 2
            # named gloo: a group of its own, built as a NCCL world builds its gloo ones; auto on gloo: the mesh's
            assert g["mesh_group"] is (cross == "auto")


def test_point_to_point_through_host_buffers(runs):
    for run in runs:
        for rank, r in enumerate(run):
            shape, values = r["p2p"]
            other = (rank + 2) % 4
            assert shape == [2, 3]
            assert values == [v + 10 * other for v in range(6)]


def test_the_probe_measures_the_cross_group_and_says_how(runs):
    plain, staged = runs
    for run, through_host in ((plain, False), (staged, True)):
        for r in run:
            cross = r["probe"]["cross"]
            assert r["probe"]["cross_backend"] == cross["backend"] == "gloo"
            assert cross["staged_through_host"] is through_host
            assert cross["ranks"] == 2 and cross["seconds"] > 0 and cross["busbw_gb_s"] > 0


@pytest.mark.parametrize("name", [*SPECS, "authenticated"])
def test_staged_gloo_groups_train_bit_for_bit_as_the_mesh_group(runs, name):
    plain, staged = runs
    for p, s in zip(plain, staged):
        assert np.array_equal(p[name]["global"], s[name]["global"]), name
        assert np.array_equal(p[name]["local"], s[name]["local"]), name
        assert p[name].get("sent") == s[name].get("sent"), name  # staging copies are not traffic
        assert p[name]["rounds"] == s[name]["rounds"] > 0


def test_the_staged_run_went_through_host_buffers_and_reused_them(runs):
    plain, staged = runs
    assert not any(r["staged_comm"] for r in plain)
    for r in staged:
        assert r["staged_comm"]
        # a few shapes in all (pseudo-gradients, fragments, payload parts), each pooled: not one per exchange
        assert 0 < r["buffers"] < 40, r["buffers"]


def test_authenticated_payloads_are_tagged_on_host_bytes_inside_the_staging(runs):
    plain, staged = runs
    assert all(r["auth_order"] == ["AuthenticatedComm", "Comm"] for r in plain)
    assert all(r["auth_order"] == ["StagedComm", "AuthenticatedComm"] for r in staged)


def test_a_batchnorm_cnn_through_the_trainer_crosses_staged_bit_for_bit(runs):
    plain, staged = runs
    for p, s in zip(plain, staged):
        assert len(p["bn"]) == len(s["bn"]) > 0
        assert all(np.array_equal(a, b) for a, b in zip(p["bn"], s["bn"]))
    # the running statistics were averaged across the islands: every rank ends on the same ones
    assert all(np.array_equal(a, b) for a, b in zip(staged[0]["bn"], staged[2]["bn"]))
