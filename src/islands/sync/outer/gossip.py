"""Decentralised gossip (LIT-302, LIT-254, LIT-315): no global average, each island mixes with its peers.

Every H steps each island sends its fp32 parameters point to point (Comm.exchange, one batch of
isend/irecv, ledger kind "outer_params") to the out-peers the topology names for this round, and
replaces its parameters by a mix of its own and what its in-peers sent. Mixing rule, per topology:

  regular graphs (ring, exp)   x_i <- (x_i + sum_{j in in(i)} x_j) / (1 + d)
      Every node has in-degree = out-degree = d, so the mixing matrix has rows and columns summing
      to 1 (doubly stochastic): a round keeps the islands' average exactly. Payload: d vectors sent.
  irregular graphs (random)    push-sum (LIT-254): node i holds a weight w_i (1 at the start) and
      sends (w_i x_i, w_i) / (s + 1) to each of its s out-peers, keeping one share itself;
      y_i <- own share + received numerators, w_i <- own share + received weights, x_i <- y_i / w_i.
      In-degrees vary, so uniform weights would be biased towards nodes many others picked;
      push-sum shares are column stochastic, which keeps sum_i w_i x_i and sum_i w_i = n, so the
      islands converge to the w-weighted average (the plain average when mixing alone, w = 1).
      Payload: the vector plus one fp32 weight, s times.
  aggregate=<robust>           x_i <- aggregator([x_i] + [x_j for j in in(i)]) over the received
      parameters (no weights; SOTA-220, issue 5's "robust neighbour averaging"). A robust aggregator
      does not keep the average; what it buys is that one bad neighbour cannot drag x_i anywhere.
      Coordinate median and trimmed mean over two inputs are the mean, so they need >= 2 in-peers
      (ring, random:s>=2) to outvote one neighbour. With fewer inputs than the aggregator needs (a
      random round can give a node no in-peer), the node keeps its own parameters (`isolated`).

  compressor=<c>               compressed gossip (choco.py, LIT-920): each directed edge keeps a public
      estimate of its sender; a round sends c(x_i - estimate) instead of x_i and mixes the estimates.
      Needs a regular topology (ring, exp) or an aggregator: push-sum's weights ride on exact vectors.
      Payload: the compressor's payload, once per out-peer.

Elastic membership (islands.runtime.elastic): a round is one committed operation whose graph is the topology
over the ranks of the epoch it commits in (`_mix_elastic`), so a round a death interrupts is planned again
with the survivors and every member mixes by the same graph (docs/membership.md). Compressed gossip is refused
there: its edge estimates belong to pairs of ranks.

Evaluation (`eval_model`) is this island's OWN model as of its last gossip round: there is no
global model in gossip. The last step always gossips. Consensus distance (how far the islands are
from their average) is measured by the experiments outside training traffic (consensus_distance).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from islands.aggregate.base import Aggregator
from islands.aggregate.coordinate import Mean
from islands.compress.base import Compressor
from islands.runtime.contracts import PointToPoint
from islands.sync.outer.base import OuterStrategy
from islands.sync.outer.choco import EdgeEstimates, check_compressor
from islands.sync.outer.topology import ExponentialGraph, Topology

KIND = "outer_params"


# ---- mixing arithmetic (shared by the strategy and the in-process simulation) ---------------------
def uniform_mix(own: torch.Tensor, received: Sequence[torch.Tensor]) -> torch.Tensor:
    acc = own.clone()
    for r in received:  # sorted peer order: the same sum on every run
        acc += r
    return acc.div_(1 + len(received))


def push_sum_share(x: torch.Tensor, weight: float, out_degree: int) -> torch.Tensor:
    """(w x, w) / (out_degree + 1): what the node sends to each out-peer and keeps for itself."""
    share = torch.cat([x * weight, x.new_tensor([weight])])
    return share.div_(out_degree + 1)


def push_sum_combine(own_share: torch.Tensor, received: Sequence[torch.Tensor]) -> tuple[torch.Tensor, float]:
    total = own_share.clone()
    for r in received:
        total += r
    weight = float(total[-1])
    return total[:-1].div_(weight), weight


def robust_mix(aggregator, own: torch.Tensor, received: Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """(new x, isolated): the aggregate of own + received, or own when too few inputs arrived."""
    inputs = [own, *received]
    if len(inputs) < aggregator.min_inputs():
        return own.clone(), True
    return aggregator.aggregate(inputs).to(torch.float32), False


def consensus_distance(vectors: Sequence[torch.Tensor]) -> float:
    """Mean over nodes of ||x_i - mean_j x_j||_2 (0 = every node holds the same vector)."""
    rows = torch.stack([v.reshape(-1).to(torch.float64) for v in vectors])
    return float((rows - rows.mean(0)).norm(dim=1).mean())


def simulate_mixing(
    topology,
    vectors: Sequence[torch.Tensor],
    rounds: int,
    aggregator: Aggregator | None = None,
    compressor=None,
    gamma: float = 0.3,
    start: torch.Tensor | None = None,
) -> tuple[list[float], list[torch.Tensor]]:
    """Pure gossip in one process (no training, no sockets), with the strategy's own arithmetic.

    `compressor`: compressed gossip (choco.py) with consensus step `gamma`, every edge estimate starting at `start`
    (default zeros). Returns the consensus distance before round 0 and after each round, and the final vectors."""
    xs = [v.detach().to(torch.float32).reshape(-1).clone() for v in vectors]
    n = len(xs)
    if compressor is not None:
        return _simulate_compressed(
            topology, xs, rounds, compressor, gamma, torch.zeros_like(xs[0]) if start is None else start.reshape(-1)
        )
    aggs = None
    if aggregator is not None and not isinstance(aggregator, Mean):
        aggs = [copy.deepcopy(aggregator) for _ in range(n)]  # one per node: stateful ones keep their own
    weights = [1.0] * n
    dists = [consensus_distance(xs)]
    for t in range(rounds):
        graph = [topology.peers(t, i, n) for i in range(n)]
        if aggs is None and not topology.regular:
            shares = [push_sum_share(xs[i], weights[i], len(graph[i][0])) for i in range(n)]
            mixed = [push_sum_combine(shares[i], [shares[j] for j in graph[i][1]]) for i in range(n)]
            xs, weights = [m[0] for m in mixed], [m[1] for m in mixed]
        elif aggs is None:
            xs = [uniform_mix(xs[i], [xs[j] for j in graph[i][1]]) for i in range(n)]
        else:
            xs = [robust_mix(aggs[i], xs[i], [xs[j] for j in graph[i][1]])[0] for i in range(n)]
        dists.append(consensus_distance(xs))
    return dists, xs


def _simulate_compressed(topology, xs, rounds, compressor, gamma, start):
    n = len(xs)
    est = [EdgeEstimates(compressor, start, gamma) for _ in range(n)]
    dists = [consensus_distance(xs)]
    for t in range(rounds):
        graph = [topology.peers(t, i, n) for i in range(n)]
        sent = [est[i].outgoing(i, xs[i], graph[i][0]) for i in range(n)]
        for i in range(n):
            est[i].incoming(i, {j: sent[j][i] for j in graph[i][1]})
        xs = [est[i].mixed(i, xs[i], *graph[i]) for i in range(n)]
        dists.append(consensus_distance(xs))
    return dists, xs


# ---- the outer strategy ---------------------------------------------------------------------------
class Gossip(OuterStrategy):
    name = "gossip"

    buffer_policy = "own"  # no global average: the eval model takes this island's own buffers

    def __init__(
        self,
        every: int = 4,
        topology: Topology | None = None,
        aggregator: Aggregator | None = None,
        seed: int = 0,
        compressor: Compressor | None = None,
        gamma: float = 0.3,
    ):
        """`every` H: local steps between gossip rounds. `topology`: exp when none (ExponentialGraph(), one peer at
        distance 2^k, SOTA-226), ring (Ring()) or random:s=S (RandomPeers(s, seed), S fresh out-peers per round,
        push-sum, SOTA-223), given as the object (a spec names it in text). `aggregator`:
        robust neighbour averaging. `seed`: seeds topology=random's per-round draws (the same on every rank) when a
        spec names the topology; a RandomPeers object carries its own. `compressor`: compressed
        gossip with per-edge estimates (choco.py; topkq, dct-topk, topk, randomk, sign). `gamma`: its consensus step
        size in (0, 1] (1 with a lossless compressor is plain gossip; smaller damps a lossy one's lag; 0.3 trained
        best of 0.1 and 0.3 in `islands bench gossip-compressed`, 1 does not converge with a 5% sketch)."""
        super().__init__()
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = int(every)
        topology = ExponentialGraph() if topology is None else topology
        if not isinstance(topology, Topology) or isinstance(topology, str):
            hint = (
                f"; parse text at the edge: islands.sync.outer.parse_topology({topology!r}, seed={seed})"
                if isinstance(topology, str)
                else ""
            )
            raise TypeError(
                f"Gossip takes a topology object (ExponentialGraph(), Ring(), RandomPeers(s, seed)); "
                f"got {type(topology).__name__} {topology!r}{hint}"
            )
        self.topology, self.seed = topology, int(seed)
        self.aggregator = None if isinstance(aggregator, Mean) else aggregator
        self.weight = 1.0  # push-sum weight (random topology with mean mixing); stays 1 otherwise
        self.isolated = 0  # robust rounds in which too few inputs arrived to aggregate
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma (consensus step size) must be in (0, 1], got {gamma!r}")
        if compressor is not None and self.push_sum:
            raise ValueError(
                f"compressed gossip needs a regular topology (ring, exp) or an aggregator; "
                f"topology={self.topology!r} mixes with push-sum weights, which ride on exact vectors"
            )
        if compressor is not None:
            check_compressor(compressor)
        self.compressor, self.gamma = compressor, float(gamma)
        self.estimates: EdgeEstimates | None = None

    @property
    def push_sum(self) -> bool:
        return self.aggregator is None and not self.topology.regular

    def elastic_refusal(self) -> str | None:
        if self.compressor is not None:  # edge estimates are kept per (sender rank, receiver rank)
            return (
                "compressed gossip is not supported in an elastic job: its edge estimates belong to pairs of "
                "ranks, which change when members come and go; drop compressor="
            )
        return None

    def setup(self) -> None:
        # an elastic comm: wrap has asked elastic_refusal before any collective
        if not self.comm.elastic and self.comm.size > 1 and not isinstance(self.comm, PointToPoint):
            raise TypeError(
                f"gossip sends point to point and needs a Comm with exchange(); {type(self.comm).__name__} has none"
            )
        if self.compressor is not None:
            # the edge estimates start from one point every island knows: island 0's (agreed in wrap)
            self.estimates = EdgeEstimates(self.compressor, self.global_flat.clone(), self.gamma)

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0

    def after_step(self, model, optimizer, step):
        self.tick(step)
        if self.due(step):
            self.gossip_round()
            self.synced()

    def final_sync(self) -> None:
        self.gossip_round()

    def gossip_round(self) -> None:
        x = self.local.read()
        n = self.comm.size
        if self.comm.elastic:
            x = self._mix_elastic(x)
        elif n > 1:
            send_to, recv_from = self.topology.peers(self.rounds, self.comm.rank, n)
            x = self._mix(x, send_to, recv_from)
        self.global_flat = x
        self.publish()
        self.adopt_global()
        self.rounds += 1

    def _mix(self, x: torch.Tensor, send_to: list[int], recv_from: list[int]) -> torch.Tensor:
        if self.estimates is not None:
            return self._mix_compressed(x, send_to, recv_from)
        if self.push_sum:
            share = push_sum_share(x, self.weight, len(send_to))
            got = self.comm.exchange({p: share for p in send_to}, recv_from, like=share, kind=KIND)
            x, self.weight = push_sum_combine(share, [got[p] for p in recv_from])
            return x
        got = self.comm.exchange({p: x for p in send_to}, recv_from, like=x, kind=KIND)
        received = [got[p] for p in recv_from]
        if self.aggregator is None:
            return uniform_mix(x, received)
        x, isolated = robust_mix(self.aggregator, x, received)
        self.isolated += int(isolated)
        return x

    def _mix_elastic(self, x: torch.Tensor) -> torch.Tensor:
        """Elastic membership (islands.runtime.elastic): the round's graph is the topology over the members of the
        epoch the exchange commits in (a member gone mid-round: planned again with the survivors' ranks), so
        every member mixes by the same graph; push-sum shares follow that graph's out-degrees."""

        def plan(rank: int, size: int):
            send_to, recv_from = self.topology.peers(self.rounds, rank, size)
            payload = push_sum_share(x, self.weight, len(send_to)) if self.push_sum else x
            return {p: payload for p in send_to}, recv_from

        like = torch.empty(x.numel() + 1 if self.push_sum else x.numel())
        got, send_to, recv_from = self.comm.exchange_planned(plan, like=like, kind=KIND)
        received = [got[p] for p in recv_from]
        if self.push_sum:
            x, self.weight = push_sum_combine(push_sum_share(x, self.weight, len(send_to)), received)
            return x
        if self.aggregator is None:
            return uniform_mix(x, received)
        x, isolated = robust_mix(self.aggregator, x, received)
        self.isolated += int(isolated)
        return x

    def _mix_compressed(self, x: torch.Tensor, send_to: list[int], recv_from: list[int]) -> torch.Tensor:
        me, est = self.comm.rank, self.estimates
        assert est is not None  # _mix comes here only with estimates
        got = self.comm.exchange(est.outgoing(me, x, send_to), recv_from, like=est.like(), kind=KIND)
        est.incoming(me, got)
        if self.aggregator is None:
            return est.mixed(me, x, send_to, recv_from)
        x, isolated = robust_mix(self.aggregator, x, [est.edges[(j, me)] for j in sorted(recv_from)])
        self.isolated += int(isolated)
        return x

    # ---- state ------------------------------------------------------------------------------------
    def extra_state(self) -> dict:
        # rounds (in the base state) and the topology's seed fix every future round's graph
        out = {
            "topology": repr(self.topology),
            "topology_state": self.topology.state_dict(),
            "weight": self.weight,
            "isolated": self.isolated,
        }
        if self.aggregator is not None:
            out["aggregator"] = self.aggregator.state_dict()
        if self.estimates is not None:
            out["estimates"] = self.estimates.state_dict()
        return out

    def load_extra_state(self, state: dict) -> None:
        saved = state.get("topology")
        if saved is not None and saved != repr(self.topology):
            raise ValueError(
                f"gossip: checkpoint was written with topology={saved}, this run uses "
                f"{self.topology!r}; resume with the same topology"
            )
        self.topology.load_state_dict(state.get("topology_state", {}))
        self.weight = float(state.get("weight", 1.0))
        self.isolated = int(state.get("isolated", 0))
        if self.aggregator is not None and "aggregator" in state:
            self.aggregator.load_state_dict(state["aggregator"])
        if self.estimates is not None:
            if "estimates" not in state:
                raise ValueError(
                    "gossip: this run compresses (compressor=...), the checkpoint was written without "
                    "a compressor; resume with the same outer spec"
                )
            self.estimates.load_state_dict(state["estimates"])
