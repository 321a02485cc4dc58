"""The parameter server across gloo processes (issue #36): the key acceptance check, the same schedule run as two
processes (server thread on rank 0, island 1 pushing over gloo point-to-point) and as two islands.simulate islands
ends on the same global model bit for bit; plus 4-bit pushes with a quorum, and first-come arrivals."""

from __future__ import annotations

import pytest
import torch

import islands
from harness.outer import batch, run_world, tiny_model
from islands.models import sequence_loss
from islands.outer import FirstCome, InProcessServer, ParameterServer, Quant4, VirtualClock
from islands.sync.outer.ps_link import HEADER_BYTES

STEPS, H = 8, 2
SCHEDULES = {
    # name: ParameterServer keywords (arrivals fixed by a virtual clock: island 1's rounds take 3x as long)
    "fp32": dict(max_staleness=2),
    "quant4-quorum": dict(max_staleness=3, quorum=2, compressor=Quant4(256), shards=3),
    "held-window": dict(max_staleness=3, quorum=2, wait=0.5),  # island 0 waits up to 0.5 virtual s per window
}


def train(world, host=None, **kw) -> dict:
    before = world.ledger.snapshot()["sent"].get("ps_push", 0)
    pulled = world.ledger.snapshot()["received"].get("ps_pull", 0)
    torch.manual_seed(0)
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    arrivals = kw.pop("arrivals", None) or VirtualClock([1.0, 3.0])
    strategy = ParameterServer(inner_steps=H, arrivals=arrivals, host=host, **kw)
    strategy.wrap(model, opt, world)
    for i in range(STEPS):
        b = batch(world.rank, i)
        sequence_loss(model(b[:, :-1]), b[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        strategy.after_step(model, opt, i)
    strategy.finish(model)
    server = strategy.loop.state if strategy.loop is not None else None
    return {
        "global": strategy.global_flat.numpy().copy(),
        "counts": dict(strategy.counts),
        "version": strategy.version,
        "server": None if server is None else dict(server.counts),
        "sent": world.ledger.snapshot()["sent"].get("ps_push", 0) - before,
        "pulled": world.ledger.snapshot()["received"].get("ps_pull", 0) - pulled,
    }


def train_batchnorm(world, trail: list | None = None, **kw) -> dict[str, torch.Tensor]:
    """A BatchNorm CNN (running statistics and a step counter as buffers) through the same server across processes:
    the model each island ends with, buffers included. `trail`: gets the island's buffers after each answer it
    adopted (the server's mean of the islands' latest, ps_buffers.py), as numpy."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 3),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    strategy = ParameterServer(inner_steps=H, arrivals=VirtualClock([1.0, 3.0]), **{"max_staleness": 2, **kw})
    if trail is not None:
        adopt = strategy.adopt

        def watched(reply):
            adopt(reply)
            trail.append(torch.cat([b.reshape(-1).double() for b in model.buffers()]).numpy().copy())

        strategy.adopt = watched  # type: ignore[method-assign]
    strategy.wrap(model, opt, world)
    g = torch.Generator().manual_seed(world.rank)  # each island its own data: its own running statistics
    for i in range(STEPS + 2 * world.rank):  # and its own number of steps: its own num_batches_tracked
        x, y = torch.randn(8, 1, 6, 6, generator=g) * (1 + world.rank), torch.randint(0, 3, (8,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        strategy.after_step(model, opt, i)
    strategy.finish(model)
    return {k: v.clone() for k, v in model.state_dict().items()}


def batchnorm_trail(world, **kw) -> dict:
    """train_batchnorm's buffers after each answer, what island 1 pushed over gloo (bytes), and its final model."""
    before = world.ledger.snapshot()["sent"].get("ps_push", 0)
    trail: list = []
    state = train_batchnorm(world, trail, **kw)
    sent = world.ledger.snapshot()["sent"].get("ps_push", 0) - before
    return {"trail": trail, "sent": sent, "state": {k: v.numpy().copy() for k, v in state.items()}}


def _all(world) -> dict:
    out: dict = {
        "batchnorm": train_batchnorm(world),
        "batchnorm-held": train_batchnorm(world, **SCHEDULES["held-window"]),
        "batchnorm-trail": batchnorm_trail(world),
    }
    out |= {name: train(world, **kw) for name, kw in SCHEDULES.items()}
    out["first-come"] = train(world, arrivals=FirstCome())
    from islands.runtime.payload_auth import authenticate_payloads

    authenticate_payloads(world, token="ps-test-secret")  # from here on every push and answer travels sealed
    out["sealed"] = train(world, **SCHEDULES["fp32"])
    out["batchnorm-sealed"] = batchnorm_trail(world)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_world(_all, size=2, islands=2)


def simulate(kw: dict) -> list[dict]:
    torch.set_num_threads(1)
    server = InProcessServer()
    return islands.simulate.run(lambda world: train(world, host=server, **kw), islands=2)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_simulated_and_multi_process_runs_end_on_the_same_global_model(ranks, name):
    sim = simulate(dict(SCHEDULES[name]))
    for rank in (0, 1):
        real = ranks[rank][name]
        assert real["counts"] == sim[rank]["counts"] and real["version"] == sim[rank]["version"]
        assert real["global"].tobytes() == sim[rank]["global"].tobytes(), f"island {rank}"
    assert ranks[0][name]["global"].tobytes() == ranks[1][name]["global"].tobytes()
    hosted = [r["server"] for r in sim if r["server"] is not None]  # the island that set up first hosts it
    assert len(hosted) == 1 and ranks[0][name]["server"] == hosted[0]


def test_four_bit_pushes_are_smaller_on_the_wire(ranks):
    # island 1 pushes over gloo: header + payload; 4-bit payloads are ~1/8 of fp32's
    fp32, q4 = ranks[1]["fp32"]["sent"], ranks[1]["quant4-quorum"]["sent"]
    assert 0 < q4 < fp32 / 6


def test_first_come_arrivals_finish_with_every_push_applied_or_refused(ranks):
    a, b = ranks[0]["first-come"], ranks[1]["first-come"]
    assert a["global"].tobytes() == b["global"].tobytes()
    server = a["server"]
    assert server["pushes"] == a["counts"]["pushes"] + b["counts"]["pushes"] == 2 * STEPS // H
    assert server["refused"] == a["counts"]["refused"] + b["counts"]["refused"]


def test_islands_train_runs_the_ps_spec_across_two_processes(tmp_path):
    import json

    from harness.cli import TINY_FLAGS, islands_cli

    run_dir = tmp_path / "ps"
    argv = ["train", "--workers", "2", "--islands", "2", "--outer", "ps:inner_steps=4", "--steps", "12"]
    assert islands_cli(*argv, "--output.run_dir", str(run_dir), *TINY_FLAGS) == 0
    record = json.loads((run_dir / "run.json").read_text())
    for rank in record["comm"]["per_rank"]:  # 3 rounds of 4 steps pushed, then DONE (answered with the final model)
        assert rank["calls"]["ps_push"] == 4 and rank["calls"]["ps_pull"] == 4
        assert rank["sent"]["ps_push"] > 3 * 4 * 11000  # three fp32 pseudo-gradients (the LM has > 11k parameters)
    # rank 0's server loop thread reports its own CPU and its state's bytes (ps_report.py): the 6 pushes applied
    report = record["parameter_server"]
    assert report["mode"] == "thread" and report["complete"]
    (server,) = report["servers"]
    assert server["pushes_received"] == server["pushes_applied"] + server["pushes_refused"] == 6
    assert server["cpu_seconds"] > 0 and server["peak_memory"] == "state_tensors"
    assert server["peak_memory_bytes"] >= 2 * 4 * server["parameters"][1]  # the model and one delta, fp32


def test_sealed_pushes_and_answers_give_the_unsealed_model(ranks):
    # the same virtual-clock schedule with authenticated payloads: the tags add bytes, not a single changed value
    for rank in (0, 1):
        assert ranks[rank]["sealed"]["global"].tobytes() == ranks[rank]["fp32"]["global"].tobytes()
    # island 1 sent 4 pushes (header + payload) and a DONE (header): 9 tensors, each with its 32-byte MAC
    assert ranks[1]["sealed"]["sent"] == ranks[1]["fp32"]["sent"] + 9 * 32


@pytest.mark.parametrize("name", ["batchnorm", "batchnorm-held"])  # the second with windows that wait (quorum 2)
def test_a_batchnorm_model_ends_as_one_model_buffers_included(ranks, name):
    # the islands see different data for different numbers of steps; every answer brings the server's mean of their
    # statistics (the largest step count) and the job's end averages them once more, so both processes end on one
    # model. Each island counts on from the largest count it adopted, so the count passes any island's own steps
    a, b = ranks[0][name], ranks[1][name]
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert a["1.num_batches_tracked"].item() > STEPS + 2
    assert not torch.equal(a["1.running_var"], torch.ones(4))


def test_batchnorm_buffers_travel_through_the_server_across_processes_as_in_a_simulation(ranks):
    """Island 1's pushes carry its buffers over gloo and every answer brings the server's mean back (ps_buffers.py):
    after each answer each process holds the statistics the simulated run's island holds, bit for bit, statistics
    that are neither island's own (the other's are in the mean); sealed, the same values, each buffer tensor with
    its MAC."""
    torch.set_num_threads(1)
    server = InProcessServer()
    sim = islands.simulate.run(lambda world: batchnorm_trail(world, host=server), islands=2)
    for rank in (0, 1):
        real, simulated = ranks[rank]["batchnorm-trail"], sim[rank]
        assert len(real["trail"]) == len(simulated["trail"]) == 1 + (STEPS + 2 * rank) // H  # pushes, then DONE
        for got, want in zip(real["trail"], simulated["trail"]):
            assert got.tobytes() == want.tobytes()
        sealed = ranks[rank]["batchnorm-sealed"]
        assert all(a.tobytes() == b.tobytes() for a, b in zip(sealed["trail"], real["trail"]))
    # island 1's first answer already holds island 0's statistics: island 0's first pushes came before it, with
    # more steps counted than island 1's own H
    first0, first1 = ranks[0]["batchnorm-trail"]["trail"][0], ranks[1]["batchnorm-trail"]["trail"][0]
    assert first1[-1] > H and first0.tobytes() != first1.tobytes()
    # island 1's 5 pushes: a header, the fp32 delta and the float64 buffer vector (4 + 4 running values and the
    # count); its DONE a header. Sealed: each of those 16 tensors carries a 32-byte MAC
    numel = sum(
        v.size for k, v in ranks[1]["batchnorm-trail"]["state"].items() if "running" not in k and "num" not in k
    )
    assert ranks[1]["batchnorm-trail"]["sent"] == 5 * (HEADER_BYTES + 4 * numel + 9 * 8) + HEADER_BYTES
    assert ranks[1]["batchnorm-sealed"]["sent"] == ranks[1]["batchnorm-trail"]["sent"] + 16 * 32
