"""Gossip topologies: who sends to whom in each round, as small objects with explicit state.

Every topology answers `peers(round, rank, n) -> (send_to, recv_from)`, lists of ranks of the
cross-island group, sorted, never containing `rank`. The answer depends only on (state, round, rank, n),
so every rank computes the same graph without talking, and j in send_to(i) exactly when i in recv_from(j).

`regular` says whether every node has the same in- and out-degree in every round. For a regular
graph, uniform weights over self + in-peers make a doubly stochastic mixing matrix (rows and columns
sum to 1), so a round preserves the average exactly; an irregular graph needs push-sum weights
(islands.sync.outer.gossip states which one each topology gets).

    Ring()                 send to and receive from both neighbours (one neighbour when n = 2)
    ExponentialGraph()     one peer at distance 2^k, k = round mod ceil(log2 n) (SOTA-226, LIT-254)
    RandomPeers(s, seed)   s fresh out-peers per round, drawn from (seed, round) (SOTA-223, LIT-315)
    parse_topology("random:s=2", seed=0) -> RandomPeers(2, seed=0)     (TOPOLOGIES, islands.spec)
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch

from islands.spec import Registry, Spec


@runtime_checkable
class Topology(Protocol):
    name: str
    regular: bool

    def peers(self, round: int, rank: int, n: int) -> tuple[list[int], list[int]]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def _check(rank: int, n: int) -> None:
    if n < 1 or not 0 <= rank < n:
        raise ValueError(f"rank must be in [0, n) with n >= 1; got rank={rank}, n={n}")


class Ring:
    """Undirected ring: each node exchanges with rank-1 and rank+1 (degree 2, or 1 when n = 2)."""

    name = "ring"
    regular = True

    def peers(self, round: int, rank: int, n: int) -> tuple[list[int], list[int]]:
        _check(rank, n)
        both = sorted({(rank - 1) % n, (rank + 1) % n} - {rank})
        return both, list(both)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def __repr__(self) -> str:
        return "ring"


class ExponentialGraph:
    """Directed one-peer exponential graph: in round t send to rank + 2^k, receive from rank - 2^k.

    k = t mod ceil(log2 n). With weights 1/2 on self and the one in-peer, after rounds k = 0..log2(n)-1
    every node holds the exact average when n is a power of two (each round doubles the group a
    node has averaged with, as in a hypercube; SOTA-226). One vector sent per node per round.
    """

    name = "exp"
    regular = True

    @staticmethod
    def period(n: int) -> int:
        return max(1, math.ceil(math.log2(n))) if n > 1 else 1

    def distance(self, round: int, n: int) -> int:
        return 2 ** (round % self.period(n))

    def peers(self, round: int, rank: int, n: int) -> tuple[list[int], list[int]]:
        _check(rank, n)
        if n == 1:
            return [], []
        d = self.distance(round, n)  # 2^k < n, so the peer is never the node itself
        return [(rank + d) % n], [(rank - d) % n]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def __repr__(self) -> str:
        return "exp"


class RandomPeers:
    """Every round each node sends to s distinct random other nodes (Epidemic Learning, LIT-315).

    The draw for round t comes from a generator seeded with (seed, t), the same on every rank, and
    every rank draws every node's out-peers, so each knows who sends to it. In-degrees vary per round
    (not regular), so gossip mixes with push-sum weights over this topology. Re-seeding per round
    makes the whole generator state (seed, round): any round's graph can be recomputed on resume.
    """

    name = "random"
    regular = False

    def __init__(self, s: int = 1, seed: int = 0):
        if not isinstance(s, int) or isinstance(s, bool) or s < 1:
            raise ValueError(f"random topology: s (out-peers per round) must be an int >= 1, got {s!r}")
        self.s, self.seed = s, int(seed)
        self._cache: tuple[int, int, list[list[int]]] | None = None  # (round, n, out-peers of every node)

    def graph(self, round: int, n: int) -> list[list[int]]:
        """Out-peers of every node in `round` (sorted lists)."""
        if self.s > n - 1:
            raise ValueError(
                f"random topology: s={self.s} out-peers need at least s+1={self.s + 1} nodes, "
                f"the group has {n}; lower s"
            )
        if self._cache is not None and self._cache[:2] == (round, n):
            return self._cache[2]
        # one seed per (seed, round); the modulus keeps it inside manual_seed's 64-bit range
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + round) % (2**63 - 1))
        out = []
        for i in range(n):
            others = torch.randperm(n - 1, generator=g)[: self.s].tolist()
            out.append(sorted(j if j < i else j + 1 for j in others))  # skip i itself
        self._cache = (round, n, out)
        return out

    def peers(self, round: int, rank: int, n: int) -> tuple[list[int], list[int]]:
        _check(rank, n)
        if n == 1:
            return [], []
        out = self.graph(round, n)
        return list(out[rank]), [i for i in range(n) if rank in out[i]]

    def state_dict(self) -> dict:
        return {"s": self.s, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state and int(state["s"]) != self.s:
            raise ValueError(
                f"random topology: checkpoint has s={state['s']}, this run s={self.s}; "
                "resume with the same topology spec"
            )
        if state:
            self.seed = int(state["seed"])
            self._cache = None

    def __repr__(self) -> str:
        return f"random:s={self.s}"


TOPOLOGIES = Registry("topology", {"exp": ExponentialGraph, "ring": Ring, "random": RandomPeers}, base=Topology)


def parse_topology(spec: str | Spec, seed: int = 0) -> Topology:
    """'exp' | 'ring' | 'random' | 'random:s=S' -> a topology; `seed` seeds random's draws unless the spec gives
    its own. SpecError (a ValueError) names the valid forms."""
    return TOPOLOGIES.build(spec, seed=seed)
