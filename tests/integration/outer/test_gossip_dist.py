"""Gossip across four gloo ranks (four islands of one worker), one spawned world for every check.

Mixing-only checks set each rank's parameters by hand and call gossip_round() directly (no training);
starting values are small integers, so exponential-graph averages are exact in fp32 and ranks must
agree bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from harness.outer import run_world

D = 6  # parameters of the tiny model: Linear(2, 2)


def _strategy(world, spec: str):
    from islands.sync.outer import make_outer

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = make_outer(spec)
    s.wrap(model, opt, world)
    return s, model, opt


def _start(rank: int) -> torch.Tensor:
    return torch.arange(D, dtype=torch.float32) * (rank + 1) + 8 * rank


def _sent(world, before) -> tuple[int, int]:
    after = world.ledger.snapshot()
    return (
        after["sent"].get("outer_params", 0) - before["sent"].get("outer_params", 0),
        after["received"].get("outer_params", 0) - before["received"].get("outer_params", 0),
    )


def _mixing(world, spec: str, rounds: int, byzantine: int | None = None) -> dict:
    s, _, _ = _strategy(world, spec)
    s.local.write(_start(world.rank))
    before = world.ledger.snapshot()
    peers = []
    for _ in range(rounds):
        if world.rank == byzantine:
            s.local.write(torch.full((D,), 1e6))  # keeps sending a huge vector, every round
        peers.append(s.topology.peers(s.rounds, world.rank, world.size))
        s.gossip_round()
    sent, received = _sent(world, before)
    return {
        "x": s.local.read().numpy(),
        "sent": sent,
        "received": received,
        "peers": peers,
        "weight": s.weight,
        "eval_equals_local": bool(
            torch.equal(torch.cat([p.reshape(-1) for p in s.eval_model(None).parameters()]), s.local.read())
        ),
    }


def _resume(world) -> dict:
    a, _, _ = _strategy(world, "gossip:topology=random:s=2,seed=5")
    a.local.write(_start(world.rank))
    a.gossip_round()
    snap = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in a.state_dict().items()}
    a.gossip_round()
    a.gossip_round()
    b, _, _ = _strategy(world, "gossip:topology=random:s=2,seed=5")
    b.load_state_dict(snap)
    b.gossip_round()
    b.gossip_round()
    return {
        "a": a.local.read().numpy(),
        "b": b.local.read().numpy(),
        "rounds": (a.rounds, b.rounds),
        "weights": (a.weight, b.weight),
    }


def _cadence(world) -> list[int]:
    s, model, opt = _strategy(world, "gossip:every=2,topology=ring")
    synced = []
    for step in range(5):
        x = torch.randn(4, 2, generator=torch.Generator().manual_seed(world.rank * 10 + step))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        before = s.rounds
        s.after_step(model, opt, step)
        if s.rounds > before:
            synced.append(step)
    before = s.rounds
    s.finish(model)  # the final synchronisation, after the last step
    if s.rounds > before:
        synced.append("finish")
    return synced


def _all(world) -> dict:
    return {
        "exp": _mixing(world, "gossip:topology=exp", 2),
        "ring": _mixing(world, "gossip:topology=ring", 2),
        "random": _mixing(world, "gossip:topology=random:s=2,seed=3", 3),
        "median": _mixing(world, "gossip:topology=ring,aggregate=median", 3, byzantine=0),
        "mean_attacked": _mixing(world, "gossip:topology=ring", 3, byzantine=0),
        "resume": _resume(world),
        "cadence": _cadence(world),
    }


def test_gossip_four_ranks():
    res = run_world(_all, size=4, islands=4, timeout=120)
    n, vec = 4, D * 4
    start = np.stack([_start(r).numpy() for r in range(n)])

    # exponential graph: exact consensus after log2(4) = 2 rounds, identical bits on every rank
    exp = [r["exp"] for r in res]
    for r in exp:
        assert np.array_equal(r["x"], start.mean(0))
        assert r["eval_equals_local"]  # eval_model is the node's own model after its last round
        assert (r["sent"], r["received"]) == (2 * vec, 2 * vec)  # one peer per round

    # ring: not in 2 rounds; two peers per round
    ring = np.stack([r["ring"]["x"] for r in res])
    assert np.abs(ring - ring.mean(0)).max() > 0.5
    assert np.allclose(ring.mean(0), start.mean(0), atol=1e-4)
    for r in res:
        assert (r["ring"]["sent"], r["ring"]["received"]) == (2 * 2 * vec, 2 * 2 * vec)

    # random peers: every rank saw the same graph; bytes = s (vector + weight) per round
    rnd = [r["random"] for r in res]
    for t in range(3):
        for i in range(n):
            send_to, recv_from = rnd[i]["peers"][t]
            assert len(send_to) == 2
            assert all(i in rnd[j]["peers"][t][1] for j in send_to)
            assert all(i in rnd[j]["peers"][t][0] for j in recv_from)
    for r in rnd:
        assert r["sent"] == 3 * 2 * (vec + 4)
        assert r["received"] == sum(len(p[1]) for p in r["peers"]) * (vec + 4)
    # push-sum keeps the weighted average: sum w_i x_i = sum x_i(0), sum w_i = n
    weights = np.array([r["weight"] for r in rnd])
    assert abs(weights.sum() - n) < 1e-5
    assert np.allclose((weights[:, None] * np.stack([r["x"] for r in rnd])).sum(0), start.sum(0), rtol=1e-5)

    # robust: rank 0 keeps sending 1e6; with median the honest ranks stay inside their starting range
    lo, hi = start[1:].min(0), start[1:].max(0)
    for r in res[1:]:
        assert np.all(r["median"]["x"] >= lo) and np.all(r["median"]["x"] <= hi)
        assert r["mean_attacked"]["x"].max() > 1e4  # the plain mean is dragged off

    # state round trip: resumed strategy reproduces the next rounds bit for bit
    for r in res:
        assert np.array_equal(r["resume"]["a"], r["resume"]["b"])
        assert r["resume"]["rounds"] == (3, 3) and r["resume"]["weights"][0] == r["resume"]["weights"][1]

    # cadence: every=2 over 5 steps syncs after steps 1, 3 and, in finish, after the last step 4
    assert all(r["cadence"] == [1, 3, "finish"] for r in res)
