"""Islands of k workers on the parameter server (issue #36): the island is one participant, its leader speaks for it.

Inner DDP (or ZeRO-1) keeps an island's replicas identical, so one worker's pseudo-gradient is the island's. The
leader (local index 0) alone pushes, pulls and sends DONE, on its island's number (the island index, its cross
rank); the server counts islands, not workers. Its mates take each answer from the leader over a gloo group of the
island's own (`share`), so every worker of the island adopts the same global model, version and buffers, and counts
the same pushes. Before a push the island pools its buffers (`pool`: their mean over its workers, as a DiLoCo round
does, base.ISLAND_BUFFER_KIND), so the leader pushes statistics of every worker's batches, not its own only.

    side = island_side(island_comm, numel, buffers)   # LoneWorker for an island of one, else an IslandRelay
    pooled = side.pool(carried.read())                  # every worker: the island's mean buffer vector
    reply = side.share(link.send(...) if side.leader else None)   # every worker: the leader's answer

Every worker of the island calls `pool` and `share` at the same points, on the main thread, in step with the inner
strategy's collectives (they run on another group). In an elastic job the leader alone takes the island's number
from the job's store (ps_elastic.py) and `number` hands it to its mates; a mate that loses its leader (or the
leader a mate) leaves with IslandBroken, one line, as the elastic runtime's own relay does, and the launcher starts
the island again as a whole. The relay's group is gloo on the CPU whatever the job's device
(answers arrive on the CPU), and waits as long as the leader's link may: the thread mode's longest wait for an
answer, or the service's timeout when longer (RELAY_MARGIN_S more), not the job's collective timeout, since a mate
waits there while its leader waits for the server (at the end, for the slowest island's DONE).

The fixed layout (runtime.world): island i's workers are ranks i*k .. i*k + k - 1, its leader rank i*k. An elastic
island's default group is the island itself (runtime.world.island_world): one block of k, its leader rank 0.
"""

from __future__ import annotations

import datetime as _dt
from typing import Protocol

import torch
import torch.distributed as dist

from islands.runtime.elastic.island_comm import RELAY_KIND, island_collective
from islands.sync.outer.base import ISLAND_BUFFER_KIND
from islands.sync.outer.ps_link import THREAD_MODE_TIMEOUT_S, Reply
from islands.sync.outer.ps_server import Ack

RELAY_MARGIN_S = 60.0  # the relay waits this much longer than the leader's longest wait, so the leader's error shows
_HEAD = 5  # accepted, version, staleness, stepped, whether buffers follow


class IslandSide(Protocol):
    """How the workers of one island take part in the server's rounds."""

    @property
    def leader(self) -> bool:
        """Whether this worker talks to the server for its island."""
        ...

    @property
    def workers(self) -> int:
        """The island's workers (the samples behind a push are theirs together)."""
        ...

    def pool(self, vector: torch.Tensor) -> torch.Tensor:
        """The island's mean of a float64 buffer vector (ps_buffers.IslandBuffers.read), on every worker."""
        ...

    def share(self, reply: Reply | None) -> Reply:
        """The leader's answer on every worker: the leader passes it, its mates None."""
        ...

    def number(self, island: int) -> int:
        """The leader's island number on every worker (an elastic island's, which only its leader takes)."""
        ...


class LoneWorker:
    """An island of one worker: it speaks for itself."""

    leader = True
    workers = 1

    def pool(self, vector: torch.Tensor) -> torch.Tensor:
        return vector

    def share(self, reply: Reply | None) -> Reply:
        assert reply is not None, "an island of one worker is its own leader"
        return reply

    def number(self, island: int) -> int:
        return island


class IslandRelay:
    """An island of several workers (module docstring): `group` its gloo group, `source` its leader's global rank,
    `numel` the model's parameters, `buffers` the values of a buffer vector a reply may carry (0: none)."""

    def __init__(self, group, source: int, leader: bool, workers: int, numel: int, buffers: int, ledger=None):
        self.group, self.source, self.workers = group, source, workers
        self.leader, self.numel, self.buffers, self.ledger = leader, numel, buffers, ledger

    def pool(self, vector: torch.Tensor) -> torch.Tensor:
        # counts (num_batches_tracked) are equal on the island's workers: their sum over k divides back exactly
        out = vector.detach().to("cpu", torch.float64).clone()
        with _relay():
            dist.all_reduce(out, group=self.group)
        self._count(ISLAND_BUFFER_KIND, out.numel() * 8, out.numel() * 8)
        return out.div_(self.workers)

    def share(self, reply: Reply | None) -> Reply:
        head = torch.zeros(_HEAD + self.buffers, dtype=torch.float64)
        flat = torch.empty(self.numel, dtype=torch.float32)
        if self.leader:
            assert reply is not None, "the island's leader shares its answer"
            a = reply.ack
            head[:_HEAD] = torch.tensor(
                [float(a.accepted), a.version, a.staleness, float(a.stepped), float(reply.buffers is not None)]
            )
            if reply.buffers is not None:
                head[_HEAD:] = reply.buffers.reshape(-1)
            flat.copy_(reply.flat.reshape(-1))
        with _relay():
            dist.broadcast(head, src=self.source, group=self.group)
            dist.broadcast(flat, src=self.source, group=self.group)
        nbytes = head.numel() * 8 + flat.numel() * 4
        self._count(RELAY_KIND, nbytes if self.leader else 0, 0 if self.leader else nbytes)
        if self.leader:
            assert reply is not None
            return reply
        h = [int(x) for x in head[:_HEAD].tolist()]
        return Reply(Ack(bool(h[0]), h[1], h[2], bool(h[3])), flat, head[_HEAD:].clone() if h[4] else None)

    def number(self, island: int) -> int:
        box = torch.tensor([island], dtype=torch.int64)
        with _relay():
            dist.broadcast(box, src=self.source, group=self.group)
        self._count(RELAY_KIND, 8 if self.leader else 0, 0 if self.leader else 8)
        return int(box.item())

    def _count(self, kind: str, sent: int, received: int) -> None:
        if self.ledger is not None:  # island traffic: neither kind crosses islands (runtime.comm)
            self.ledger.record(kind, sent, received)


def island_side(island_comm, numel: int, buffers: int, waits_s: float = 0.0, ledger=None) -> IslandSide:
    """The side of this worker's island: LoneWorker without an island Comm (one worker, or islands.simulate), else an
    IslandRelay over a gloo group of the island's workers, made on every worker of the job (torch's new_group is
    collective over the default group). Every worker of the island checks that they hold models of one size: the
    leader's pseudo-gradient stands for the island only when each holds the whole model (ddp or zero1 inside, not a
    pipeline's stages). `waits_s`: the leader link's longest wait for an answer, when longer than the thread mode's."""
    if island_comm is None or island_comm.size <= 1:
        return LoneWorker()
    k, me, world = island_comm.size, dist.get_rank(), dist.get_world_size()
    timeout = _dt.timedelta(seconds=max(THREAD_MODE_TIMEOUT_S, waits_s) + RELAY_MARGIN_S)
    blocks = [list(range(first, first + k)) for first in range(0, world, k)]
    group, _ = dist.new_subgroups_by_enumeration(blocks, timeout=timeout, backend="gloo")
    sizes = torch.tensor([numel, -numel], dtype=torch.int64)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    if int(sizes[0]) != -int(sizes[1]):
        raise ValueError(
            f"ps: the workers of an island hold {-int(sizes[1])} to {int(sizes[0])} parameters; the island's leader "
            "pushes for all of them, so each must hold the whole model (inner ddp or zero1, not a pipeline's stages)"
        )
    source = me - me % k
    return IslandRelay(group, source, me == source, k, numel, buffers, ledger)


def leaders(islands: int, workers: int) -> list[int]:
    """The global ranks that talk to the server: each island's leader (the fixed layout, module docstring)."""
    return [i * workers for i in range(islands)]


def _relay():
    """A collective of the island's relay: a worker of it that is gone fails it, and the island leaves as a whole
    (island_comm.island_collective's IslandBroken)."""
    return island_collective("its relay to the parameter server", then="")
