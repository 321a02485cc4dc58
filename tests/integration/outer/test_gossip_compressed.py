"""Compressed gossip (choco.py): per-edge public estimates, the mixing step, and the strategy on four gloo ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.outer import run_world
from islands.compress import QSGD, RandomK, SharedRandomK, TopK, TopKQ
from islands.sync.outer import make_outer, parse_topology, simulate_mixing
from islands.sync.outer.choco import EdgeEstimates
from islands.sync.outer.gossip import Gossip
from islands.sync.outer.topology import RandomPeers

LOSSLESS = TopKQ(ratio=1.0, bits=32)  # every entry, fp32 values: decode(compress(x)) == x


def _vectors(n, dim=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(dim, generator=g) for _ in range(n)]


@pytest.mark.parametrize("topology", ["ring", "exp"])
def test_a_lossless_compressor_with_gamma_one_is_plain_gossip(topology):
    xs = _vectors(8)
    plain, want = simulate_mixing(parse_topology(topology), xs, 5)
    comp, got = simulate_mixing(parse_topology(topology), xs, 5, compressor=LOSSLESS, gamma=1.0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert comp == pytest.approx(plain, abs=1e-4)


@pytest.mark.parametrize("topology", ["ring", "exp"])
def test_a_lossy_round_keeps_the_average_and_reaches_consensus(topology):
    xs = _vectors(4, dim=500)
    mean = torch.stack(xs).mean(0)
    lossy = TopKQ(ratio=0.1, bits=8)
    dists, got = simulate_mixing(parse_topology(topology), xs, 150, compressor=lossy, gamma=0.3)
    torch.testing.assert_close(torch.stack(got).mean(0), mean, rtol=0, atol=1e-4)  # every round keeps it
    assert dists[-1] < 1e-2 * dists[0]
    # the estimates lag a 10% sketch: plain gossip's full step (gamma = 1) over them stalls far from consensus
    stalled, _ = simulate_mixing(parse_topology(topology), xs, 150, compressor=lossy, gamma=1.0)
    assert stalled[-1] > 0.1 * stalled[0]


def test_both_ends_of_an_edge_hold_the_same_estimate():
    start = torch.zeros(50)
    a, b = EdgeEstimates(TopKQ(ratio=0.1, bits=2), start), EdgeEstimates(TopKQ(ratio=0.1, bits=2), start)
    x = torch.randn(50)
    for _ in range(4):
        sent = a.outgoing(0, x, [1])
        assert sent[1].dtype == torch.uint8 and sent[1].numel() == a.nbytes
        b.incoming(1, {0: sent[1]})  # keyed by sender
        assert torch.equal(a.edges[(0, 1)], b.edges[(0, 1)])
    # what the sketch left out shrinks round by round (the estimate converges to x)
    assert (x - a.edges[(0, 1)]).norm() < 0.8 * x.norm()


def test_state_round_trip_continues_bit_for_bit():
    xs = _vectors(1, dim=64)
    a = EdgeEstimates(RandomK(ratio=0.2, seed=3), torch.zeros(64))  # a compressor with its own RNG state
    a.outgoing(0, xs[0], [1, 2])
    saved = a.state_dict()
    first = a.outgoing(0, xs[0] * 2, [1, 2])
    b = EdgeEstimates(RandomK(ratio=0.2, seed=3), torch.zeros(64))
    b.load_state_dict(saved)
    again = b.outgoing(0, xs[0] * 2, [1, 2])
    for p in (1, 2):
        assert torch.equal(first[p], again[p])
        assert torch.equal(a.edges[(0, p)], b.edges[(0, p)])
    with pytest.raises(ValueError, match="another model"):
        EdgeEstimates(RandomK(ratio=0.2), torch.zeros(65)).load_state_dict(saved)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: Gossip(topology=RandomPeers(2), compressor=TopKQ()), ["regular topology (ring, exp)", "push-sum"]),
        (lambda: Gossip(compressor=SharedRandomK()), ["self-contained", "topkq"]),
        (lambda: Gossip(compressor=TopK(warmup=True)), ["fixed layout", "warmup=0"]),
        (lambda: Gossip(compressor=TopKQ(), gamma=0.0), ["gamma", "(0, 1]"]),
    ],
)
def test_bad_compressed_gossip_is_refused_with_the_reason(make, words):
    with pytest.raises(ValueError) as e:
        make()
    for w in words:
        assert w in str(e.value)


def test_the_spec_builds_it():
    s = make_outer("gossip:every=2,topology=ring,compressor=(topkq:ratio=0.05,bits=4),gamma=0.3")
    assert isinstance(s.compressor, TopKQ) and s.gamma == 0.3
    assert isinstance(make_outer("gossip:compressor=(qsgd)").compressor, QSGD)


# ---- four gloo ranks ------------------------------------------------------------------------------
D = 6  # Linear(2, 2)


def _start(rank: int) -> torch.Tensor:
    return torch.arange(D, dtype=torch.float32) * (rank + 1) + 8 * rank


def _strategy(world, spec):
    torch.manual_seed(world.rank)  # a different initial model on every rank: the setup agrees on island 0's
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = make_outer(spec)
    s.wrap(model, opt, world)
    return s


def _four(world) -> dict:
    spec = "gossip:topology=exp,compressor=(topkq:ratio=0.5,bits=8),gamma=0.5"
    s = _strategy(world, spec)
    wrapped_start = s.local.read().numpy()
    s.estimates.start = torch.zeros(D)  # the mixing check below starts every estimate at zero, as the simulation
    s.estimates.edges.clear()
    s.local.write(_start(world.rank))
    before = world.ledger.snapshot()["sent"].get("outer_params", 0)
    s.gossip_round()
    snap = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.state_dict().items()}
    import copy

    snap = copy.deepcopy(snap)
    for _ in range(3):
        s.gossip_round()
    sent = world.ledger.snapshot()["sent"].get("outer_params", 0) - before
    b = _strategy(world, spec)
    b.load_state_dict(snap)
    for _ in range(3):
        b.gossip_round()
    return {
        "x": s.local.read().numpy(),
        "resumed": b.local.read().numpy(),
        "sent": sent,
        "payload": s.estimates.nbytes,
        "wrapped_start": wrapped_start,
    }


def test_compressed_gossip_on_four_ranks_equals_the_simulation_and_resumes():
    res = run_world(_four, size=4, islands=4, timeout=120)
    for r in res:  # every island started from island 0's initial parameters
        assert np.array_equal(r["wrapped_start"], res[0]["wrapped_start"])
    _, want = simulate_mixing(
        parse_topology("exp"), [_start(r) for r in range(4)], 4, compressor=TopKQ(ratio=0.5, bits=8), gamma=0.5
    )
    for r, w in zip(res, want):
        assert np.array_equal(r["x"], w.numpy())  # the strategy's rounds are the simulation's, bit for bit
        assert np.array_equal(r["resumed"], r["x"])  # resumed after round 1: the same next three rounds
        assert r["sent"] == 4 * r["payload"] < 4 * D * 4  # one out-peer per round on exp, each a payload
