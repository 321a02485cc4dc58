"""Gossip topologies and mixing arithmetic in one process (no sockets): fast and exact."""

from __future__ import annotations

import pytest
import torch

from islands.aggregate import CoordinateMedian
from islands.sync.outer.gossip import consensus_distance, push_sum_combine, push_sum_share, simulate_mixing
from islands.sync.outer.topology import ExponentialGraph, RandomPeers, Ring, parse_topology


def start_vectors(n: int, d: int = 5) -> list[torch.Tensor]:
    # small integers: every partial average below is a dyadic fraction, exact in fp32
    return [torch.arange(d, dtype=torch.float32) * (i + 1) + 8 * i for i in range(n)]


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_exponential_graph_reaches_exact_consensus_in_log2_n_rounds(n):
    xs = start_vectors(n)
    rounds = n.bit_length() - 1
    dists, final = simulate_mixing(ExponentialGraph(), xs, rounds)
    mean = torch.stack(xs).mean(0)
    for x in final:
        assert torch.equal(x, mean)
    assert dists[-1] == 0.0 and all(d > 0 for d in dists[:-1])


def test_ring_does_not_reach_consensus_in_two_rounds():
    xs = start_vectors(4)
    dists, final = simulate_mixing(Ring(), xs, 2)
    assert dists[-1] > 0.05 * dists[0]
    # but it keeps the average exactly (doubly stochastic) and does contract
    assert torch.allclose(torch.stack(final).mean(0), torch.stack(xs).mean(0), atol=1e-5)
    assert dists[2] < dists[1] < dists[0]


@pytest.mark.parametrize("n,s", [(4, 1), (4, 2), (8, 3), (5, 4)])
def test_random_peers_every_send_matched_and_deterministic(n, s):
    a, b = RandomPeers(s, seed=7), RandomPeers(s, seed=7)
    graphs = set()
    for t in range(6):
        views = [a.peers(t, i, n) for i in range(n)]
        assert views == [b.peers(t, i, n) for i in range(n)]  # a second "rank" computes the same graph
        for i, (send_to, recv_from) in enumerate(views):
            assert len(send_to) == s and len(set(send_to)) == s and i not in send_to and i not in recv_from
            for j in send_to:
                assert i in views[j][1]  # every send has a matching receive
            for j in recv_from:
                assert i in views[j][0]
        graphs.add(tuple(tuple(v[0]) for v in views))
    if s < n - 1:
        assert len(graphs) > 1  # fresh peers: the graph changes between rounds
    if s < n - 1:  # another seed draws another sequence of graphs
        assert [RandomPeers(s, seed=8).graph(t, n) for t in range(6)] != [a.graph(t, n) for t in range(6)]


def test_push_sum_keeps_the_average_and_converges_on_random_peers():
    xs = start_vectors(8)
    dists, final = simulate_mixing(RandomPeers(2, seed=1), xs, 30)
    mean = torch.stack(xs).mean(0)
    assert dists[-1] < 1e-4 * dists[0]
    for x in final:
        assert torch.allclose(x, mean, atol=1e-4)


def test_push_sum_shares_conserve_mass():
    x, w = torch.tensor([2.0, -4.0]), 0.5
    share = push_sum_share(x, w, 3)
    assert torch.allclose(share * 4, torch.tensor([1.0, -2.0, 0.5]))
    back, weight = push_sum_combine(share, [share, share, share])
    assert torch.allclose(back, x) and weight == pytest.approx(w)


def test_uniform_weights_on_random_peers_would_be_biased():
    # why random uses push-sum: with uneven in-degrees, plain averaging drifts off the mean
    n, topo = 8, RandomPeers(2, seed=1)
    xs = start_vectors(n)
    mean0 = torch.stack(xs).mean(0)
    for t in range(3):
        graph = [topo.peers(t, i, n) for i in range(n)]
        xs = [(xs[i] + sum(xs[j] for j in graph[i][1])) / (1 + len(graph[i][1])) for i in range(n)]
    assert not torch.allclose(torch.stack(xs).mean(0), mean0, atol=1e-3)


def test_robust_mixing_keeps_honest_nodes_in_the_honest_range():
    xs = start_vectors(6)
    xs[0] = torch.full((5,), 1e6)
    lo, hi = torch.stack(xs[1:]).min(0).values, torch.stack(xs[1:]).max(0).values
    _, final = simulate_mixing(Ring(), xs, 3, aggregator=CoordinateMedian())
    for x in final[1:]:
        assert bool(((x >= lo) & (x <= hi)).all())
    _, mean_final = simulate_mixing(Ring(), xs, 3)
    assert float(mean_final[1].max()) > float(hi.max()) * 10  # the mean has no such guarantee


def test_consensus_distance():
    assert consensus_distance([torch.ones(3), torch.ones(3)]) == 0.0
    assert consensus_distance([torch.zeros(2), torch.tensor([2.0, 0.0])]) == pytest.approx(1.0)


def test_topology_specs_and_errors():
    assert isinstance(parse_topology("exp"), ExponentialGraph)
    assert isinstance(parse_topology("ring"), Ring)
    r = parse_topology("random:s=3", seed=4)
    assert (r.s, r.seed) == (3, 4)
    assert parse_topology("random:3").s == 3 and parse_topology("random").s == 1
    for bad in ("star", "random:k=2", "random:s=0", "ring:s=1"):
        with pytest.raises(ValueError):
            parse_topology(bad)
    with pytest.raises(ValueError, match="at least"):
        RandomPeers(4).peers(0, 0, 4)
    with pytest.raises(ValueError, match="rank"):
        Ring().peers(0, 4, 4)
    assert Ring().peers(0, 0, 2) == ([1], [1])
    assert ExponentialGraph().peers(1, 0, 8) == ([2], [6])
    assert [ExponentialGraph().distance(t, 6) for t in range(4)] == [1, 2, 4, 1]


def test_outer_spec_accepts_gossip():
    from islands.sync.outer import Gossip, make_outer, parse_outer

    spec = parse_outer("gossip:every=4,topology=(random:s=2),aggregator=median,seed=3")
    g = make_outer(spec)
    assert isinstance(g, Gossip) and g.every == 4 and repr(g.topology) == "random:s=2" and g.topology.seed == 3
    assert g.aggregator is not None and not g.push_sum
    older = parse_outer("gossip:every=4,topology=random:s=2,aggregate=median,seed=3")  # unparenthesised still reads
    assert older.spec == spec.spec
    assert make_outer("gossip:topology=(random:s=2,seed=5),seed=3").topology.seed == 5  # the topology's own wins
    assert make_outer("gossip:topology=random:s=1").push_sum
    for bad in ("gossip:topology=star", "gossip:every=0", "gossip:aggregate=nope"):
        with pytest.raises(ValueError):
            parse_outer(bad)


def test_gossip_takes_a_topology_object_and_text_is_parsed_at_the_edge():
    from islands.outer import ExponentialGraph, Gossip, RandomPeers, Ring
    from islands.sync.outer import make_outer

    assert isinstance(Gossip().topology, ExponentialGraph)
    assert isinstance(Gossip(topology=Ring()).topology, Ring)
    with pytest.raises(TypeError, match=r"topology object .*parse_topology\('ring'"):
        Gossip(topology="ring")
    built = make_outer("gossip:topology=random:s=2,seed=3").topology  # the spec's seed reaches the topology
    assert isinstance(built, RandomPeers) and (built.s, built.seed) == (2, 3)
