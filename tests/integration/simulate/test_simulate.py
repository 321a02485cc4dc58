"""islands.simulate: M islands in one process, the real strategy code, against the same job as M gloo processes.

The job: the full Trainer with a tiny ByteTransformer, AdamW and an outer strategy, each island reading its own
deterministic batches. Two islands sum in the same order as gloo, so the simulated parameters must equal the
multi-process run's bit for bit (global and local, after the final synchronisation)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.flags import tiny
from harness.outer import batch, run_world, tiny_model

STEPS = 8  # streaming H=4, F=2: fragment 1 starts an exchange at the last step, which finish() then awaits
SPECS = ["diloco:inner_steps=3", "streaming-diloco:inner_steps=4,fragments=2,tau=1", "gossip:every=2"]


def _data(shard, shards):
    def gen():
        step = 0
        while True:
            b = batch(shard, step)
            yield b[:, :-1], b[:, 1:]
            step += 1

    return gen()


def train(world, spec: str) -> dict:
    """What both runs execute on every island; returns plain numpy (run_world passes results through a queue)."""
    import islands
    from islands.models import sequence_loss
    from islands.sync.outer import make_outer

    torch.set_num_threads(1)  # equal intra-op threads in both runs: CPU reductions depend on them
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    strategy = islands.Stack(outer=make_outer(spec))
    trainer = islands.Trainer(
        model=model,
        optimizer=opt,
        loss_fn=sequence_loss,
        train_data=_data,
        world=world,
        strategy=strategy,
        callbacks=[],
    )
    trainer.fit(STEPS)
    glob = strategy.eval_model(trainer.model)
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()]).numpy().copy()  # noqa: E731
    return {"global": flat(glob), "local": flat(model), "sent": dict(world.ledger.snapshot()["sent"])}


def _train_diloco(world):
    return train(world, SPECS[0])


def _train_streaming(world):
    return train(world, SPECS[1])


def _train_gossip(world):
    return train(world, SPECS[2])


FNS = {SPECS[0]: _train_diloco, SPECS[1]: _train_streaming, SPECS[2]: _train_gossip}


@pytest.mark.parametrize("spec", SPECS[:2])
def test_two_simulated_islands_equal_two_gloo_processes_bit_for_bit(spec):
    from islands import simulate

    threads = torch.get_num_threads()
    try:
        sim = simulate.run(FNS[spec], islands=2)
    finally:
        torch.set_num_threads(threads)
    real = run_world(FNS[spec], size=2, islands=2)
    for s, r in zip(sim, real):
        np.testing.assert_array_equal(s["global"], r["global"])
        np.testing.assert_array_equal(s["local"], r["local"])
        assert s["sent"] == r["sent"]  # the ledger counts what the real job sends
    assert sim[0]["sent"], "the simulated islands exchanged nothing"
    np.testing.assert_array_equal(sim[0]["global"], sim[1]["global"])
    assert not np.array_equal(sim[0]["global"], train(__import__("islands").World.single(), spec)["global"])


def test_point_to_point_strategy_equals_gloo():
    """Gossip exchanges through point-to-point sends: exact for any number of islands; 3 here."""
    from islands import simulate

    threads = torch.get_num_threads()
    try:
        sim = simulate.run(_train_gossip, islands=3)
    finally:
        torch.set_num_threads(threads)
    real = run_world(_train_gossip, size=3, islands=3)
    for s, r in zip(sim, real):
        np.testing.assert_array_equal(s["local"], r["local"])


def test_simulation_is_deterministic_with_dropout():
    """Each island has its own generator state with its turn: dropout masks do not depend on thread timing,
    and differ between islands only as they would between processes seeded alike (they draw the same stream)."""
    from islands import simulate

    def main(world):
        torch.manual_seed(0)
        layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        out = []
        for _ in range(4):
            x = torch.full((2, 8), float(world.rank + 1))
            layer(x).sum().backward()
            opt.step()
            opt.zero_grad()
            out.append(torch.rand(1).item())
        flat = torch.cat([p.detach().reshape(-1) for p in layer.parameters()])
        world.comm("cross").all_reduce(flat)
        return flat.numpy().copy(), out

    a = simulate.run(main, islands=3)
    b = simulate.run(main, islands=3)
    for (fa, ra), (fb, rb) in zip(a, b):
        np.testing.assert_array_equal(fa, fb)
        assert ra == rb
    assert a[0][1] == a[1][1]  # same seed, same stream on every island, as in M processes


def test_collectives_match_and_errors_name_the_island():
    from islands import simulate

    def main(world):
        c = world.comm("cross")
        t = torch.tensor([float(world.rank + 1)])
        s = c.all_reduce(t.clone()).item()
        m = c.all_reduce(t.clone(), op=torch.distributed.ReduceOp.MAX).item()
        g = [x.item() for x in c.all_gather(t)]
        b = c.broadcast(t.clone(), src=2).item()
        rs = c.reduce_scatter(torch.arange(6.0) * (world.rank + 1)).tolist()
        objs = world.all_gather_object({"r": world.rank})
        return s, m, g, b, rs, objs

    out = simulate.run(main, islands=3)
    for r, (s, m, g, b, rs, objs) in enumerate(out):
        assert (s, m, g, b) == (6.0, 3.0, [1.0, 2.0, 3.0], 3.0)
        assert rs == [float(6 * (2 * r)), float(6 * (2 * r + 1))]
        assert objs == [{"r": 0}, {"r": 1}, {"r": 2}]

    def broken(world):
        if world.rank == 1:
            raise ValueError("island one breaks")
        world.comm("cross").all_reduce(torch.ones(1))

    with pytest.raises(RuntimeError, match=r"island 1 of 2.*island one breaks"):
        simulate.run(broken, islands=2, timeout_s=20)

    def mismatched(world):
        c = world.comm("cross")
        c.all_reduce(torch.ones(1)) if world.rank == 0 else c.all_gather(torch.ones(1))

    with pytest.raises(RuntimeError, match="collectives differ"):
        simulate.run(mismatched, islands=2, timeout_s=20)

    with pytest.raises(ValueError, match="islands must be an integer >= 1"):
        simulate.run(main, islands=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_islands_on_one_gpu_are_reproducible_and_agree():
    """Two DiLoCo islands on one GPU (what NCCL cannot do with two processes): the global models agree across
    islands, and a second run gives the same bits (per-island CUDA generator states, one island at a time)."""
    from islands import simulate

    def main(world):
        import islands
        from islands.models import sequence_loss
        from islands.sync.outer import make_outer

        torch.use_deterministic_algorithms(True, warn_only=True)
        model = tiny_model().to(world.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        strategy = islands.Stack(outer=make_outer(SPECS[0]))
        trainer = islands.Trainer(
            model=model,
            optimizer=opt,
            loss_fn=sequence_loss,
            train_data=_data,
            world=world,
            strategy=strategy,
            callbacks=[],
        )
        trainer.fit(STEPS)
        glob = strategy.eval_model(trainer.model)
        assert next(glob.parameters()).device.type == "cuda"
        return torch.cat([p.detach().reshape(-1) for p in glob.parameters()]).cpu().numpy()

    a = simulate.run(main, islands=2, device="cuda")
    b = simulate.run(main, islands=2, device="cuda")
    np.testing.assert_array_equal(a[0], a[1])
    np.testing.assert_array_equal(a[0], b[0])


CLI_JOB = [
    "train",
    "--workers",
    "2",
    "--islands",
    "2",
    "--outer",
    "diloco:inner_steps=5",
    "--steps",
    "12",
    *tiny(global_batch=8, no_progress=True, device="cpu"),
]  # on a GPU machine --simulate would take the GPU, the 2 processes gloo


def test_cli_simulate_equals_the_launched_job(tmp_path):
    """`islands train --simulate`: the same job as the launched processes, the same losses and bytes."""
    import json

    from islands.cli import main

    def train(*args):
        with pytest.raises(SystemExit) as e:
            main([*CLI_JOB, *args])
        assert e.value.code == 0

    threads = torch.get_num_threads()
    try:
        train("--simulate", "--run-dir", str(tmp_path / "sim"))
    finally:
        torch.set_num_threads(threads)
    train("--run-dir", str(tmp_path / "real"))
    sim, real = (json.loads((tmp_path / d / "run.json").read_text()) for d in ("sim", "real"))
    assert sim["summary"]["final_val_loss"] == real["summary"]["final_val_loss"]
    assert [e["loss"] for e in sim["series"]["train"]] == [e["loss"] for e in real["series"]["train"]]
    assert sim["comm"]["per_rank"][0]["sent"] == real["comm"]["per_rank"][0]["sent"] != {}
    assert sim["interconnect"]["reason"].startswith("simulated")


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--workers", "4"], ["one worker per island", "workers=2 (= islands)"]),
        (["--ckpt-every", "5"], ["does not yet combine with checkpoint.every=5"]),
        (["--inner", "fsdp"], ["inner.strategy=fsdp"]),
    ],
)
def test_cli_simulate_refuses_what_it_cannot_run(tmp_path, capsys, extra, words):
    from islands.cli import main

    with pytest.raises(SystemExit) as e:
        main([*CLI_JOB, "--simulate", *extra, "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and all(w in err for w in words), err
    assert not (tmp_path / "r").exists()
