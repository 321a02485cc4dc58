"""Islands of k workers on the parameter server (issue #36; docs/parameter-server.md, "Islands of k workers"): DDP or
ZeRO-1 inside each island, the island's leader pushes and pulls for it, its mates take every answer from it. The
CLI's digits job with 2 islands of 2 workers (thread mode and servers=1) counts one participant per island on the
server and ends with every worker on one model; through the Python API, with every island's data fixed, an island of
2 workers on a virtual clock trains as an island of 1 with the same batch does, and a BatchNorm model's workers,
each on its own half of the island's batch, push the island's mean statistics and hold the same buffers after every
answer. What the server cannot take (fsdp's shards, in fixed and elastic jobs; an island whose workers hold different
parts of the model) is refused with a reason."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from harness.cli import islands_cli
from harness.outer import run_world
from islands.checkpoint.store.directory import CheckpointStore

STEPS, H, ROWS = 8, 2, 8  # steps, inner steps per round, rows of an island's batch (split over its workers)
CLOCK = [1.0, 3.0]  # virtual seconds per round of islands 0 and 1: the server applies pushes in one fixed order
DIGITS = ["--task", "digits", "--global-batch", "16", "--eval-every", "0", "--warmup", "1", "--threads", "1"]


# ---- the CLI: `islands train --workers 4 --islands 2 --inner ddp|zero1 --outer ps:...` ---------------------------
@pytest.mark.parametrize(
    "inner, outer, relays",
    [
        ("ddp", "ps:inner_steps=5", 5),  # 4 answers to pushes and the final one
        # and the first pull from the servers; compressed pulls: the leader's link steps its copy, its mate takes the
        # model (ps_pulls)
        ("zero1", "ps:inner_steps=5,servers=1,pulls=(int8)", 6),
    ],
)
def test_islands_of_two_workers_are_two_participants_and_end_on_one_model(tmp_path, inner, outer, relays):
    run = tmp_path / "run"
    argv = ["train", *DIGITS, "--workers", "4", "--islands", "2", "--inner", inner, "--outer", outer, "--steps", "20"]
    assert islands_cli(*argv, "--no-probe", "--no-progress", "--checkpoint.every", "20", "--run-dir", str(run)) == 0
    record = json.loads((run / "run.json").read_text())
    assert record["summary"]["strategy"] == f"{inner}+ps"
    (server,) = record["parameter_server"]["servers"]
    # 2 islands x 4 rounds (not 4 workers x 4), each push the samples of its island's 5 batches of 16 / 2
    assert server["pushes_received"] == server["pushes_applied"] == 8 and server["pushes_refused"] == 0
    assert server["samples_accepted"] == 8 * 5 * 8
    calls = [rank["calls"] for rank in record["comm"]["per_rank"]]
    for rank, made in enumerate(calls):
        if rank % 2:  # a mate: nothing to the server, every answer from its leader
            assert not [kind for kind in made if kind.startswith("ps_")], made
        else:
            assert made["ps_push"] >= 5 and made["ps_pull"] >= 5
        assert made["island_relay"] == relays
    # every worker's part of the final checkpoint: the final global model, the same pushes counted
    store = CheckpointStore(run / "ckpt", clean=False)
    parts = [store.load(20, rank=rank).tree for rank in range(4)]
    for part in parts[1:]:
        assert all(torch.equal(part["model"][k], parts[0]["model"][k]) for k in parts[0]["model"])
        outer_state = part["strategy"]["outer"]
        assert torch.equal(outer_state["local"], parts[0]["strategy"]["outer"]["local"])
        assert outer_state["ps_counts"] == {"pushes": 4, "refused": 0} and outer_state["ps_version"] == 8


def test_a_job_of_two_worker_islands_resumes_through_the_servers(tmp_path):
    """servers=1, checkpoints every 10 steps, then a resume to step 30: island 0's leader restores the servers from
    its part (ps_shards), island 1's leader waits for that, the mates load their own parts; the servers go on from
    the checkpoint's 8 pushes with 2 more rounds of each island, and the 4 workers end on one model. With compressed
    pulls: the restore drops the servers' copies of what the islands hold, so each island's first answer after it
    is whole again (ps_pulls)."""
    spec = "ps:inner_steps=5,servers=1,pulls=(int8)"
    common = ["train", *DIGITS, "--workers", "4", "--islands", "2", "--outer", spec]
    common += ["--no-probe", "--no-progress"]
    assert islands_cli(*common, "--steps", "20", "--checkpoint.every", "10", "--run-dir", str(tmp_path / "a")) == 0
    again = ["--steps", "30", "--checkpoint.resume", str(tmp_path / "a"), "--checkpoint.every", "30"]
    assert islands_cli(*common, *again, "--run-dir", str(tmp_path / "b")) == 0
    record = json.loads((tmp_path / "b" / "run.json").read_text())
    assert record["summary"]["steps"] == 30
    (server,) = record["parameter_server"]["servers"]
    assert server["pushes_applied"] == 8 + 2 * 2
    # each island's first pull (before the restore) and its first push's answer (after it) whole, its second coded
    assert server["pulls"]["whole"] == 2 + 2 and server["pulls"]["coded"] == 2
    store = CheckpointStore(tmp_path / "b" / "ckpt", clean=False)
    parts = [store.load(30, rank=rank).tree for rank in range(4)]
    for part in parts[1:]:
        assert all(torch.equal(part["model"][k], parts[0]["model"][k]) for k in parts[0]["model"])
        assert part["strategy"]["outer"]["ps_counts"] == {"pushes": 6, "refused": 0}


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--inner", "fsdp", "--outer", "ps:inner_steps=5"],
            ["inner.strategy=fsdp shards the parameters", "'ps' is not wired for sharded parameters"],
        ),
        (  # elastic jobs take islands of several workers (test_ps_elastic), not fsdp's shards either
            ["--elastic", "--inner", "fsdp", "--outer", "ps:inner_steps=5,servers=1"],
            ["inner.strategy=fsdp shards the parameters", "'ps' is not wired for sharded parameters"],
        ),
    ],
)
def test_what_the_server_cannot_take_is_refused_before_any_worker_starts(tmp_path, capsys, argv, words):
    run = tmp_path / "run"
    assert islands_cli("train", *DIGITS, "--workers", "4", "--islands", "2", *argv, "--run-dir", str(run)) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert not run.exists()


# ---- the Python API, each island's data fixed ----------------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _bn_cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 3),
    )


def _island_batch(island: int, step: int, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Island `island`'s batch of step `step`, whatever its size: its workers split it."""
    g = torch.Generator().manual_seed(100 * island + step)
    return torch.randn(ROWS, *shape, generator=g) * (1 + island), torch.randint(0, 3, (ROWS,), generator=g)


def _train(world, model, shape: tuple) -> dict:
    """STEPS steps of SGD under Stack(DDP, ParameterServer) on a virtual clock, worker j of an island on the j-th
    share of its island's batch. The island's buffers before each push, and each worker's after each answer."""
    from islands import Stack
    from islands.inner import DDP
    from islands.outer import ParameterServer, VirtualClock
    from islands.sync.outer.ps_buffers import IslandBuffers

    k, j = world.workers_per_island, world.local_rank
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ps = ParameterServer(inner_steps=H, arrivals=VirtualClock(CLOCK), max_staleness=3)
    strategy = Stack(inner=DDP(), outer=ps)
    before, after = [], []
    push, adopt = ps.push, ps.adopt

    def pushing():
        before.append(IslandBuffers(model.buffers()).read().numpy().copy() if list(model.buffers()) else None)
        return push()

    def adopting(reply):
        adopt(reply)
        after.append(IslandBuffers(model.buffers()).read().numpy().copy() if list(model.buffers()) else None)

    ps.push, ps.adopt = pushing, adopting  # type: ignore[method-assign]
    live = strategy.wrap(model, opt, world)
    rows = ROWS // k
    for i in range(STEPS):
        x, y = _island_batch(world.island, i, shape)
        x, y = x[j * rows : (j + 1) * rows], y[j * rows : (j + 1) * rows]
        strategy.on_batch((x, y), i)
        torch.nn.functional.cross_entropy(live(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        strategy.after_step(live, opt, i)
    strategy.finish(live)
    table = ps.loop.buffers if ps.loop is not None else None
    return {
        "global": ps.global_flat.numpy().copy(),
        "local": ps.local.read().numpy().copy(),
        "state": {key: v.numpy().copy() for key, v in model.state_dict().items()},
        "counts": dict(ps.counts),
        "version": ps.version,
        "server": dict(ps.loop.state.counts) if ps.loop is not None else None,
        "latest": {i: v.numpy().copy() for i, v in table.latest.items()} if table is not None else None,
        "before": before,
        "after": after,
        "calls": world.ledger.snapshot()["calls"],
    }


def _torn_island(world) -> str:
    """An island whose workers hold models of different sizes (as a pipeline's stages would)."""
    from islands.outer import ParameterServer

    model = torch.nn.Linear(4, 2 + world.local_rank)
    try:
        ParameterServer(inner_steps=H).wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), world)
    except ValueError as e:
        return str(e)
    return "not refused"


def _runs(world) -> dict:
    from islands.runtime.payload_auth import authenticate_payloads

    out = {"mlp": _train(world, _mlp(), (6,)), "bn": _train(world, _bn_cnn(), (1, 6, 6)), "torn": _torn_island(world)}
    authenticate_payloads(world, token="ps-islands-test")  # from here on the leaders' pushes and answers are sealed
    out["sealed"] = _train(world, _mlp(), (6,))
    return out


def _mlp_run(world) -> dict:
    return {"mlp": _train(world, _mlp(), (6,))}


@pytest.fixture(scope="module")
def two_by_two():
    return run_world(_runs, size=4, islands=2)


@pytest.fixture(scope="module")
def two_by_one():
    return run_world(_mlp_run, size=2, islands=2)


def test_an_island_of_two_workers_trains_as_an_island_of_one_with_its_batch(two_by_two, two_by_one):
    """DDP's mean of two half-batch gradients is the whole batch's up to rounding, and the virtual clock fixes the
    pushes' order: both jobs make the same pushes, with the same samples behind them (the island's, not its
    leader's share), and end on the same global model up to rounding."""
    one, two = two_by_one, [r["mlp"] for r in two_by_two]
    assert two[0]["server"] == one[0]["mlp"]["server"]
    assert two[0]["server"]["pushes"] == 2 * STEPS // H and two[0]["server"]["samples"] == 2 * STEPS * ROWS
    for rank, r in enumerate(two):
        island = one[rank // 2]["mlp"]
        assert r["counts"] == island["counts"] and r["version"] == island["version"]
        np.testing.assert_allclose(r["global"], island["global"], rtol=1e-4, atol=1e-6)
        assert r["global"].tobytes() == two[0]["global"].tobytes()  # the end's one model, on every worker
    assert np.abs(two[0]["global"] - _mlp_start()).max() > 1e-2  # it trained


def _mlp_start() -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in _mlp().parameters()]).numpy()


def test_only_the_leader_talks_to_the_server(two_by_two):
    for rank, r in enumerate(two_by_two):
        calls = r["mlp"]["calls"]
        if rank % 2:
            assert "ps_push" not in calls and "ps_pull" not in calls
        else:  # 4 pushes and a DONE
            assert calls["ps_push"] == calls["ps_pull"] == STEPS // H + 1
        assert calls["island_relay"] == STEPS // H + 1


def test_a_batchnorm_islands_workers_push_their_mean_and_hold_the_same_buffers_after_every_answer(two_by_two):
    bn = [r["bn"] for r in two_by_two]
    for island in (0, 1):
        lead, mate = bn[2 * island], bn[2 * island + 1]
        # each worker's running statistics saw its own half of the island's batches: they differ before each push
        assert all(a.tobytes() != b.tobytes() for a, b in zip(lead["before"], mate["before"]))
        # after every answer (the pushes', the final one) the island's workers hold the same buffers, bit for bit
        assert len(lead["after"]) == len(mate["after"]) == STEPS // H + 1
        assert all(a.tobytes() == b.tobytes() for a, b in zip(lead["after"], mate["after"]))
        # the server holds the island's mean of its last push, not its leader's own statistics
        pooled = (lead["before"][-1] + mate["before"][-1]) / 2
        np.testing.assert_allclose(bn[0]["latest"][island], pooled, rtol=1e-6)
        assert np.abs(bn[0]["latest"][island] - lead["before"][-1]).max() > 1e-4
    for r in bn[1:]:  # one model at the end, buffers included
        assert all(r["state"][key].tobytes() == bn[0]["state"][key].tobytes() for key in bn[0]["state"])
    assert bn[0]["state"]["1.num_batches_tracked"] >= STEPS


def test_an_island_whose_workers_hold_different_parts_is_refused(two_by_two):
    for r in two_by_two:
        assert "each must hold the whole model (inner ddp or zero1, not a pipeline's stages)" in r["torn"], r["torn"]


def test_sealed_pushes_of_island_leaders_give_the_unsealed_model(two_by_two):
    # the tags bind island numbers on both sides, though island 1 speaks from rank 2 (GlooReceiver's stride)
    for r in two_by_two:
        assert r["sealed"]["global"].tobytes() == r["mlp"]["global"].tobytes()
        assert r["sealed"]["counts"] == r["mlp"]["counts"]
