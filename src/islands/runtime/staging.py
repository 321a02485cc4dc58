"""Device tensors over a host-only transport: the cross-island group of a GPU job that talks gloo (issue #34 item 3).

Inside an island a GPU job uses NCCL; between islands, over an ordinary TCP path, islands prefers gloo
(`world.cross_backend`): a gloo group fails with an error when a peer dies, where NCCL across sites can hang
(NVIDIA/nccl#289), and gloo needs no GPU-direct network. gloo moves host memory, so a device tensor crosses in
three steps: copied into a page-locked host buffer, exchanged, copied back. `StagedComm` does those steps around
any Comm (the plain one, or one that authenticates payloads: those then hash host bytes, never device ones).

Host buffers come from `HostBuffers`, a pool keyed by dtype and size: a round's exchanges reuse the previous
round's page-locked memory (pinning is far dearer than the copy: checkpoint.store.tree measured it), and an
asynchronous all-reduce holds its buffer until it lands, so two exchanges in flight never share one.

Tensors already in host memory pass straight through (`needs_staging`), so a CPU job pays nothing.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from islands.runtime.comm import Comm, CommWrapper


def needs_staging(tensor: torch.Tensor) -> bool:
    """Whether `tensor` lives where a host-only transport cannot read it (any device but the CPU)."""
    return tensor.device.type != "cpu"


class HostBuffers:
    """Page-locked host buffers by (dtype, element count), handed out one holder at a time and given back."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()
        self.allocated = 0  # buffers made since the pool was (for tests and reports: reuse keeps it flat)

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A flat host buffer of like's dtype and element count, yours until `give`."""
        key = (like.dtype, like.numel())
        with self._lock:
            free = self._free[key]
            if free:
                return free.pop()
            self.allocated += 1
        # page-locked only where a device copies into it (pinning needs the CUDA driver)
        return torch.empty(like.numel(), dtype=like.dtype, pin_memory=like.is_cuda)

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free[(buffer.dtype, buffer.numel())].append(buffer)

    def staged(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host buffer holding tensor's values (a blocking copy: the producer's kernels finish first)."""
        host = self.take(tensor)
        host.copy_(tensor.detach().reshape(-1))
        return host

    @contextmanager
    def lent(self, tensor: torch.Tensor) -> Iterator[torch.Tensor]:
        """`staged(tensor)` for the body of a with block, given back at its end (an error included)."""
        host = self.staged(tensor)
        try:
            yield host
        finally:
            self.give(host)


class StagedComm(CommWrapper):
    """Collectives and point-to-point over `inner` (a Comm on a host-only backend) for tensors on any device.

    Implements runtime.contracts.Collectives and PointToPoint; the bytes are counted once, by `inner`'s ledger,
    as the payload the group moves (staging copies are not traffic). Results land in the caller's tensors, or in
    new tensors on the caller's device."""

    def __init__(self, inner, buffers: HostBuffers | None = None):
        super().__init__(inner)
        self.buffers = HostBuffers() if buffers is None else buffers
        self.elastic: bool = inner.elastic  # fixed for a Comm's life

    # ---- what the wrapped Comm says: size, rank, ledger, group, all_gather_object (CommWrapper), and its epoch
    @property
    def epoch(self) -> int | None:
        return self.inner.epoch

    # ---- collectives --------------------------------------------------------------------------------------
    def _in_place(self, tensor: torch.Tensor, run) -> torch.Tensor:
        """run(host) on a staged copy of `tensor`, then its values back into `tensor`."""
        if not needs_staging(tensor):
            return run(tensor)
        with self.buffers.lent(tensor) as host:
            run(host)
            tensor.copy_(host.view(tensor.shape))
        return tensor

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "all_reduce") -> torch.Tensor:
        return self._in_place(tensor, lambda t: self.inner.all_reduce(t, op=op, kind=kind))

    def broadcast(self, tensor: torch.Tensor, src: int, kind: str = "broadcast") -> torch.Tensor:
        return self._in_place(tensor, lambda t: self.inner.broadcast(t, src=src, kind=kind))

    def all_reduce_async(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "all_reduce"):
        """The staged copy is exchanged asynchronously; its values go back into `tensor` when it lands (the
        Future resolves to `tensor`). The host buffer is held until then."""
        if not needs_staging(tensor):
            return self.inner.all_reduce_async(tensor, op=op, kind=kind)
        host = self.buffers.staged(tensor)
        buffers = self.buffers

        def landed(fut):
            try:
                fut.wait()  # the exchange's own error, if any
                tensor.copy_(host.view(tensor.shape))
            finally:
                buffers.give(host)
            return tensor

        return self.inner.all_reduce_async(host, op=op, kind=kind).then(landed)

    def _gathered(self, tensor: torch.Tensor, gather) -> list[torch.Tensor]:
        if not needs_staging(tensor):
            return gather(tensor)
        with self.buffers.lent(tensor) as host:
            return [p.view(tensor.shape).to(tensor.device) for p in gather(host)]

    def all_gather(self, tensor: torch.Tensor, kind: str = "all_gather") -> list[torch.Tensor]:
        return self._gathered(tensor, lambda t: self.inner.all_gather(t, kind=kind))

    def all_gather_cat(self, tensor: torch.Tensor, kind: str = "all_gather") -> torch.Tensor:
        if not needs_staging(tensor):
            return self.inner.all_gather_cat(tensor, kind=kind)
        return torch.cat(self.all_gather(tensor, kind=kind)) if self.size > 1 else tensor

    def reduce_scatter(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "reduce_scatter") -> torch.Tensor:
        if not needs_staging(tensor):
            return self.inner.reduce_scatter(tensor, op=op, kind=kind)
        with self.buffers.lent(tensor) as host:
            return self.inner.reduce_scatter(host.view(tensor.shape), op=op, kind=kind).to(tensor.device)

    # ---- point to point -----------------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, kind: str = "p2p") -> None:
        if not needs_staging(tensor):
            return self.inner.send(tensor, dst, kind=kind)
        with self.buffers.lent(tensor) as host:
            self.inner.send(host.view(tensor.shape), dst, kind=kind)

    def recv(self, tensor: torch.Tensor, src: int, kind: str = "p2p") -> torch.Tensor:
        return self._in_place(tensor, lambda t: self.inner.recv(t.view(tensor.shape), src, kind=kind))

    exchange = Comm.exchange  # exchange_async, then wait: the same for any Comm

    def exchange_async(
        self, sends: dict[int, torch.Tensor], recv_from: list[int], like: torch.Tensor | None = None, kind: str = "p2p"
    ):
        """The sends staged to host now; what arrives is moved to the device of `like` (or of the first send)
        in wait()."""
        shape_of = like if like is not None else next(iter(sends.values()), None)
        if shape_of is None or not (needs_staging(shape_of) or any(needs_staging(t) for t in sends.values())):
            return self.inner.exchange_async(sends, recv_from, like=like, kind=kind)
        hosts = {p: self.buffers.staged(t) for p, t in sends.items()}
        host_sends = {p: h.view(sends[p].shape) for p, h in hosts.items()}
        host_like = torch.empty(shape_of.shape, dtype=shape_of.dtype) if like is not None else None
        raw, wait_inner = self.inner.exchange_async(host_sends, recv_from, like=host_like, kind=kind)
        got: dict[int, torch.Tensor] = {}
        device = shape_of.device

        def wait() -> None:
            try:
                wait_inner()
                got.update({p: t.to(device) for p, t in raw.items()})
            finally:
                for h in hosts.values():
                    self.buffers.give(h)
                hosts.clear()

        return got, wait


class StagedElasticComm(StagedComm):
    """A StagedComm around an elastic Comm (runtime.contracts.ElasticCollectives): the members' names, and the
    planned point-to-point round with its sends staged and what arrives moved to the device of `like`. An
    elastic job on a GPU crosses this way (its cross-island Comm is gloo)."""

    @property
    def names(self) -> list[str]:
        return self.inner.names

    def exchange_planned(
        self,
        plan: Callable[[int, int], tuple[dict[int, torch.Tensor], list[int]]],
        like: torch.Tensor,
        kind: str = "p2p",
    ) -> tuple[dict[int, torch.Tensor], list[int], list[int]]:
        if not needs_staging(like):
            return self.inner.exchange_planned(plan, like, kind=kind)

        def host_plan(rank: int, size: int):
            # a failed attempt plans again over the survivors: each attempt stages its own sends
            sends, recv_from = plan(rank, size)
            return {p: t.detach().to("cpu") for p, t in sends.items()}, recv_from

        host_like = torch.empty(like.shape, dtype=like.dtype)
        got, send_to, recv_from = self.inner.exchange_planned(host_plan, host_like, kind=kind)
        return {p: t.to(like.device) for p, t in got.items()}, send_to, recv_from
