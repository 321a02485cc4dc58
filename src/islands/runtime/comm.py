"""Counted collectives: every byte this rank hands to torch.distributed goes through here.

Byte definitions (payload, not wire; exact and algorithm-independent):
  all_reduce   sent = received = nbytes of the tensor
  all_gather   sent = own chunk, received = the other ranks' chunks
  reduce_scatter  sent = the n-1 slices meant for the others, received = n-1 copies of own slice
  broadcast    the source sends nbytes, every other rank receives nbytes
  send / recv  exact tensor bytes
The wire bytes of a ring all-reduce are 2(n-1)/n times the payload (nccl-tests' bus factor);
`bus_factor` is stored beside each kind so reports can derive them.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# The ledger kinds whose bytes leave an island: the outer strategies' exchanges (outer_*) and an island's pushes to
# and pulls from a parameter server (ps_*); every other kind stays inside one island
CROSS_ISLAND_PREFIXES = ("outer", "ps_")


def crosses_islands(kind: str) -> bool:
    """Whether the bytes of ledger kind `kind` travel between islands (CROSS_ISLAND_PREFIXES)."""
    return kind.startswith(CROSS_ISLAND_PREFIXES)


@dataclass
class CommLedger:
    """Exact byte and call counts per collective kind, plus time with a collective in flight."""

    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    received: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    busy_seconds: float = 0.0
    _open: int = 0
    _since: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, kind: str, sent: int, received: int) -> None:
        with self._lock:
            self.sent[kind] += int(sent)
            self.received[kind] += int(received)
            self.calls[kind] += 1

    # Time is the union of in-flight intervals, so overlapping buckets are not double counted.
    def begin(self) -> None:
        with self._lock:
            if self._open == 0:
                self._since = time.perf_counter()
            self._open += 1

    def end(self) -> None:
        with self._lock:
            self._open -= 1
            if self._open == 0:
                self.busy_seconds += time.perf_counter() - self._since

    @property
    def total_sent(self) -> int:
        return sum(self.sent.values())

    @property
    def total_received(self) -> int:
        return sum(self.received.values())

    def snapshot(self) -> dict:
        return {
            "sent": dict(self.sent),
            "received": dict(self.received),
            "calls": dict(self.calls),
            "total_sent": self.total_sent,
            "total_received": self.total_received,
            "busy_seconds": self.busy_seconds,
        }

    def reset(self) -> None:
        with self._lock:
            self.sent.clear()
            self.received.clear()
            self.calls.clear()
            self.busy_seconds = 0.0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Comm:
    """Collectives over one process group, each counted in a ledger. Synchronous unless stated.

    The concrete class of the runtime.contracts.Collectives protocol (and PointToPoint) over a torch process group."""

    elastic = False  # members never change (islands.runtime.elastic.ElasticComm says True)
    epoch: int | None = None  # an elastic Comm's membership epoch; a fixed group has none

    def __init__(self, group: dist.ProcessGroup | None = None, ledger: CommLedger | None = None):
        """`group`: a torch process group (None: the default group). `ledger`: where bytes are counted (a new
        one if not given; `World.comm()` passes the rank's own)."""
        self.group = group
        self.ledger = CommLedger() if ledger is None else ledger
        self._size: int | None = None
        self._pg: dist.ProcessGroup | None = None

    @property
    def size(self) -> int:
        # a process group's size is fixed for its life; looked up once (torch's lookup costs a bucket hook time)
        if self._size is None:
            self._size = dist.get_world_size(self.group)
        return self._size

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def _timed(self, fn):
        self.ledger.begin()
        try:
            return fn()
        finally:
            self.ledger.end()

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "all_reduce") -> torch.Tensor:
        if self.size > 1:
            self.ledger.record(kind, _nbytes(tensor), _nbytes(tensor))
            self._timed(lambda: dist.all_reduce(tensor, op=op, group=self.group))
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "all_reduce"):
        """Start an all-reduce; returns a torch.futures.Future resolving to the tensor.

        A sum goes straight to the process group object, as torch's own DDP hooks do: torch.distributed's
        all_reduce wrapper checks and looks up more than a bucket hook on a small model can afford every step."""
        if self.size == 1:
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            fut.set_result(tensor)
            return fut
        nbytes = _nbytes(tensor)
        self.ledger.record(kind, nbytes, nbytes)
        self.ledger.begin()
        if op is dist.ReduceOp.SUM or op == dist.ReduceOp.SUM:
            if self._pg is None:
                self._pg = self.group if self.group is not None else dist.group.WORLD
            assert self._pg is not None  # size > 1: the default group exists
            work = self._pg.allreduce([tensor])
        else:
            work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        ledger = self.ledger

        def _done(f):
            ledger.end()
            return tensor

        return work.get_future().then(_done)

    def all_gather(self, tensor: torch.Tensor, kind: str = "all_gather") -> list[torch.Tensor]:
        """Every rank contributes a tensor of the same shape; returns all of them in rank order."""
        n = self.size
        if n == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(n)]
        self.ledger.record(kind, _nbytes(tensor), (n - 1) * _nbytes(tensor))
        self._timed(lambda: dist.all_gather(out, tensor.contiguous(), group=self.group))
        return out

    def all_gather_cat(self, tensor: torch.Tensor, kind: str = "all_gather") -> torch.Tensor:
        """All ranks' equally shaped tensors concatenated along dim 0, in rank order (one collective)."""
        n = self.size
        if n == 1:
            return tensor
        src = tensor.contiguous()
        out = torch.empty((n * src.shape[0], *src.shape[1:]), dtype=src.dtype, device=src.device)
        self.ledger.record(kind, _nbytes(src), (n - 1) * _nbytes(src))
        self._timed(lambda: dist.all_gather_into_tensor(out, src, group=self.group))
        return out

    def reduce_scatter(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "reduce_scatter") -> torch.Tensor:
        """Sum over ranks, split along dim 0: rank r gets the r-th of n equal slices. Counted as the
        n-1 slices this rank sends to the others and the n-1 it receives."""
        n = self.size
        if n == 1:
            return tensor
        if tensor.shape[0] % n:
            raise ValueError(f"reduce_scatter: dim 0 of {tuple(tensor.shape)} must divide evenly over {n} ranks")
        src = tensor.contiguous()
        out = torch.empty((src.shape[0] // n, *src.shape[1:]), dtype=src.dtype, device=src.device)
        self.ledger.record(kind, (n - 1) * _nbytes(out), (n - 1) * _nbytes(out))
        self._timed(lambda: dist.reduce_scatter_tensor(out, src, op=op, group=self.group))
        return out

    def broadcast(self, tensor: torch.Tensor, src: int, kind: str = "broadcast") -> torch.Tensor:
        """`src` is a global rank, as in torch.distributed."""
        if self.size > 1:
            me = dist.get_rank()
            self.ledger.record(kind, _nbytes(tensor) if me == src else 0, 0 if me == src else _nbytes(tensor))
            self._timed(lambda: dist.broadcast(tensor, src=src, group=self.group))
        return tensor

    def all_gather_object(self, obj) -> list:
        """Bookkeeping gather of picklable objects over this group (torch's, not counted: not training traffic)."""
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def send(self, tensor: torch.Tensor, dst: int, kind: str = "p2p") -> None:
        self.ledger.record(kind, _nbytes(tensor), 0)
        self._timed(lambda: dist.send(tensor, dst=dst, group=self.group))

    def recv(self, tensor: torch.Tensor, src: int, kind: str = "p2p") -> torch.Tensor:
        self.ledger.record(kind, 0, _nbytes(tensor))
        self._timed(lambda: dist.recv(tensor, src=src, group=self.group))
        return tensor

    def exchange(
        self, sends: dict[int, torch.Tensor], recv_from: list[int], like: torch.Tensor | None = None, kind: str = "p2p"
    ) -> dict[int, torch.Tensor]:
        """Point-to-point in one batch: send sends[p] to each peer p, receive one tensor shaped like `like`
        (default: the first sent tensor) from each peer in recv_from. Peers are ranks of this Comm's
        group. Every send must be matched by the peer's receive in the same call (gossip, LIT-302)."""
        got, wait = self.exchange_async(sends, recv_from, like, kind)
        wait()
        return got

    def exchange_async(
        self, sends: dict[int, torch.Tensor], recv_from: list[int], like: torch.Tensor | None = None, kind: str = "p2p"
    ):
        """`exchange` started but not awaited: returns (tensors that will arrive, wait()). Compute that
        does not need them can run before wait() (ring attention's rotation, SOTA-181). The sent
        tensors must not be modified until wait() returns."""
        me, n = self.rank, self.size
        for p in [*sends, *recv_from]:
            if not 0 <= p < n or p == me:
                raise ValueError(f"exchange peer {p} must be another rank of this group (0..{n - 1}, not {me})")
        got: dict[int, torch.Tensor] = {}
        if recv_from:
            if like is None:
                if not sends:
                    raise ValueError("exchange: pass like= (shape and dtype of what arrives) when sending nothing")
                like = next(iter(sends.values()))
            got = {p: torch.empty_like(like) for p in recv_from}
        ops = [dist.P2POp(dist.isend, t.contiguous(), group=self.group, group_peer=p) for p, t in sends.items()]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=p) for p, t in got.items()]
        if not ops:
            return got, lambda: None
        self.ledger.record(kind, sum(_nbytes(t) for t in sends.values()), sum(_nbytes(t) for t in got.values()))
        self.ledger.begin()
        works = dist.batch_isend_irecv(ops)
        done: list[bool] = []

        def wait() -> None:
            if done:
                return
            try:
                for w in works:
                    w.wait()
            finally:
                done.append(True)
                self.ledger.end()

        return got, wait


class CommWrapper:
    """What a Comm wrapping another passes through unchanged: its group, size, rank, ledger and the bookkeeping gather
    (payload_auth.AuthenticatedComm tags the payloads, staging.StagedComm stages them through host memory)."""

    def __init__(self, inner):
        self.inner = inner

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def ledger(self):
        return self.inner.ledger

    @property
    def group(self):
        return self.inner.group

    def all_gather_object(self, obj) -> list:
        """Bookkeeping (run records), not training traffic: the wrapped Comm's, as it is."""
        return self.inner.all_gather_object(obj)


# nccl-tests' bus-bandwidth factors: algorithm bandwidth times this gives the per-link load.
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def as_comm(comm_or_group=None, ledger: CommLedger | None = None) -> Comm:
    """A counted Comm from what a caller has: one of ours (as it is), a torch process group, or None (the
    default group). Lets the library's hooks take a plain process group, as torch's own hooks do."""
    if comm_or_group is None or isinstance(comm_or_group, dist.ProcessGroup):
        return Comm(comm_or_group, ledger)
    return comm_or_group


def gather_objects(comm, obj) -> list:
    """all_gather of picklable objects through any Comm's tensor all_gather (pickled, padded to the longest)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    lengths = comm.all_gather(torch.tensor([data.numel()], dtype=torch.int64), kind="bookkeeping")
    padded = torch.zeros(int(max(n.item() for n in lengths)), dtype=torch.uint8)
    padded[: data.numel()] = data
    parts = comm.all_gather(padded, kind="bookkeeping")
    return [pickle.loads(p[: int(n.item())].numpy().tobytes()) for p, n in zip(parts, lengths)]
