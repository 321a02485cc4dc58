"""M islands in ONE process on one device, running the real strategy code: `islands.simulate.run(main, islands=M)`.

A multi-process job gives every island a process and a gloo/NCCL group. Here every island is a thread of this
process with its own World, whose "global" and "cross" Comms are simulated: a collective is a rendezvous of the
M threads (the k-th collective call of every island meets the k-th of every other), combined once on the
device in rank order and handed back to each. `main(world)` is what a multi-process script's main would be:
it builds its model, optimizer, strategy (DiLoCo, streaming DiLoCo, gossip, ...) and Trainer from the World it
is given; no strategy knows it is simulated. Used for DiLoCo at realistic model sizes on one GPU (M model copies
and optimizer states, no NCCL group needing one GPU per rank) and for experiments sweeping M.

Determinism: only one island computes at a time (a FIFO turn, passed on at every collective, at every
point-to-point wait, at every wait on a Future and after every optimizer step), and each island has its own
torch (CPU and CUDA), numpy and `random` generator state, swapped in with its turn and started from the
caller's state, as M processes seeded alike. So a run gives the same bits every time, dropout included, and
the values do not depend on which thread the OS runs. Background threads a strategy starts (an overlapped
exchange) run their collectives without a turn: they draw on no generator.

Equality with a multi-process run: an all-reduce sums in rank order (x0 + x1 + ... + x_{M-1}). For two islands that
is gloo's sum bit for bit (a + b == b + a in IEEE arithmetic), so a 2-island simulation gives the multi-process
run's parameters exactly (tests/integration/simulate/test_simulate.py checks it for DiLoCo and streaming DiLoCo with
the 4-bit codec). For M > 2, gloo's ring all-reduce adds each chunk in an order that depends on the chunk, so
parameters may differ from a gloo run in the last bits (they are still identical on every island, and equal between
simulated runs); gathers, broadcasts and point-to-point exchanges carry values unchanged and are exact for any M.
Intra-op thread counts change CPU reductions too: compare runs under equal torch.get_num_threads().

Limits: one worker per island (the inner strategy is the plain model; DDP inside an island needs a torch
process group); no elastic membership; the ledger counts the bytes a real job would send, but nothing moves
and no link is measured (the run record's interconnect says "simulated, link not probed").
"""

from __future__ import annotations

import random
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from islands.runtime.comm import CommLedger
from islands.runtime.world import LoneComm, World

_RUNNING = threading.Lock()  # one simulation per process: its hooks are process-wide
_THREAD = threading.local()  # .island: the simulated island whose main thread this is (current_island)
DEFAULT_TIMEOUT_S = 600.0  # a collective some island never reaches (a bug in main) fails instead of hanging


class SimulationAborted(RuntimeError):
    """Another island failed; this one stops at its next collective."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---- turns: one island computes at a time, with its own generators -----------------------------------------
class _Turns:
    """A FIFO turn over the island threads, with each island's RNG state swapped in while it holds the turn."""

    def __init__(self, islands: int, device: torch.device):
        self.cv = threading.Condition()
        self.queue: deque[int] = deque()
        self.holder: int | None = None
        self.cuda = device.type == "cuda"
        self.device = device
        start = self._capture()
        self.rng = [start for _ in range(islands)]  # every island starts where the caller's generators are
        self.local = threading.local()  # .island: this thread's island while it is an island's main thread

    def _capture(self):
        return (
            torch.get_rng_state(),
            torch.cuda.get_rng_state(self.device) if self.cuda else None,
            np.random.get_state(),
            random.getstate(),
        )

    def _restore(self, state) -> None:
        cpu, cuda, npy, py = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)
        np.random.set_state(npy)
        random.setstate(py)

    def acquire(self, island: int) -> None:
        with self.cv:
            self.queue.append(island)
            while self.holder is not None or self.queue[0] != island:
                self.cv.wait()
            self.queue.popleft()
            self.holder = island
        self._restore(self.rng[island])

    def release(self, island: int) -> None:
        self.rng[island] = self._capture()
        with self.cv:
            self.holder = None
            self.cv.notify_all()

    def mine(self) -> int | None:
        """The island whose turn this thread holds, or None (a background thread, or waiting)."""
        island = getattr(self.local, "island", None)
        return island if island is not None and self.holder == island else None

    def blocking(self):
        """A context for a wait on other islands: the turn is passed on meanwhile and taken back after."""
        return _Blocking(self)

    def yield_turn(self) -> None:
        island = self.mine()
        if island is not None:
            self.release(island)
            self.acquire(island)


class _Blocking:
    def __init__(self, turns: _Turns):
        self.turns, self.island = turns, None

    def __enter__(self):
        self.island = self.turns.mine()
        if self.island is not None:
            self.turns.release(self.island)

    def __exit__(self, *exc):
        if self.island is not None:
            self.turns.acquire(self.island)
        return False


# ---- the rendezvous --------------------------------------------------------------------------------------
class _Hub:
    """Where the islands' Comms of one scope meet. Collectives: the k-th call of every rank meets the k-th of
    every other; the last to arrive combines the inputs once. Point-to-point: FIFO mailboxes per (src, dst)."""

    def __init__(self, size: int, turns: _Turns, timeout_s: float):
        self.size, self.turns, self.timeout_s = size, turns, timeout_s
        self.cv = threading.Condition()
        self.rounds: dict[int, dict] = {}
        self.mail: dict[tuple[int, int], deque] = {}
        self.error: BaseException | None = None

    def abort(self, error: BaseException) -> None:
        with self.cv:
            if self.error is None:
                self.error = error
            self.cv.notify_all()

    def _check(self) -> None:
        if self.error is not None:
            raise SimulationAborted(f"another island failed: {self.error!r}") from None

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        if not self.cv.wait_for(lambda: done() or self.error is not None, timeout=self.timeout_s):
            error = TimeoutError(
                f"simulated {what}: not every island arrived within {self.timeout_s:.0f} s (does "
                f"every island call the same collectives in the same order?)"
            )
            self.error = self.error or error
            self.cv.notify_all()
            raise error
        self._check()

    def meet(self, rank: int, seq: int, what: str, value: Any, combine: Callable[[list], Any]) -> Any:
        """This rank's `value` for its collective number `seq`; returns combine(values in rank order)."""
        with self.turns.blocking(), self.cv:
            self._check()
            r = self.rounds.setdefault(seq, {"what": what, "values": [None] * self.size, "arrived": 0, "left": 0})
            if r["what"] != what:
                self.error = RuntimeError(
                    f"simulated collective #{seq}: island {rank} called {what} where another "
                    f"island called {r['what']}: the islands' collectives differ"
                )
                self.cv.notify_all()
                raise self.error
            r["values"][rank] = value
            r["arrived"] += 1
            if r["arrived"] == self.size:
                try:
                    r["result"] = combine(r["values"])
                except BaseException as e:
                    self.error = e
                    self.cv.notify_all()
                    raise
                r["values"] = None
                self.cv.notify_all()
            else:
                self._wait(lambda: "result" in r, what)
            r["left"] += 1
            if r["left"] == self.size:
                del self.rounds[seq]
            return r["result"]

    def post(self, src: int, dst: int, tensor: torch.Tensor) -> None:
        with self.cv:
            self._check()
            self.mail.setdefault((src, dst), deque()).append(tensor)
            self.cv.notify_all()

    def take(self, src: int, dst: int) -> torch.Tensor:
        with self.turns.blocking(), self.cv:
            box = self.mail.setdefault((src, dst), deque())
            self._wait(lambda: bool(box), f"receive from island {src} on island {dst}")
            return box.popleft()


def _reduce(op, values: list[torch.Tensor]) -> torch.Tensor:
    """The values combined in rank order (see the module docstring on equality with gloo)."""
    acc = values[0].clone()
    for v in values[1:]:
        if op == dist.ReduceOp.SUM:
            acc.add_(v)
        elif op == dist.ReduceOp.MAX:
            torch.maximum(acc, v, out=acc)
        elif op == dist.ReduceOp.MIN:
            torch.minimum(acc, v, out=acc)
        elif op == dist.ReduceOp.PRODUCT:
            acc.mul_(v)
        else:
            raise ValueError(f"simulated all_reduce supports SUM, MAX, MIN and PRODUCT; got {op}")
    return acc


class SimComm:
    """The Comm interface (islands.runtime.comm.Comm) over a _Hub: same methods, same ledger entries."""

    elastic = False
    epoch: int | None = None

    def __init__(self, hub: _Hub, rank: int, ledger: CommLedger):
        self.hub, self._rank, self.ledger = hub, rank, ledger
        self.group = None
        self._seq = 0
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return self.hub.size

    @property
    def rank(self) -> int:
        return self._rank

    def _meet(self, what: str, value, combine):
        with self._lock:  # an island's collectives are ordered; the counter follows that order
            seq = self._seq
            self._seq += 1
        self.ledger.begin()
        try:
            return self.hub.meet(self._rank, seq, what, value, combine)
        finally:
            self.ledger.end()

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "all_reduce") -> torch.Tensor:
        if self.size > 1:
            self.ledger.record(kind, _nbytes(tensor), _nbytes(tensor))
            tensor.copy_(self._meet(f"all_reduce {tuple(tensor.shape)}", tensor, lambda vs: _reduce(op, vs)))
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "all_reduce"):
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(self.all_reduce(tensor, op, kind))
        return fut

    def all_gather(self, tensor: torch.Tensor, kind: str = "all_gather") -> list[torch.Tensor]:
        n = self.size
        if n == 1:
            return [tensor]
        self.ledger.record(kind, _nbytes(tensor), (n - 1) * _nbytes(tensor))
        got = self._meet(f"all_gather {tuple(tensor.shape)}", tensor.detach().clone(), list)
        return [t.clone() for t in got]  # each island owns what it received, as over a wire

    def all_gather_cat(self, tensor: torch.Tensor, kind: str = "all_gather") -> torch.Tensor:
        if self.size == 1:
            return tensor
        return torch.cat(self.all_gather(tensor.contiguous(), kind=kind), dim=0)

    def reduce_scatter(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "reduce_scatter") -> torch.Tensor:
        n = self.size
        if n == 1:
            return tensor
        if tensor.shape[0] % n:
            raise ValueError(f"reduce_scatter: dim 0 of {tuple(tensor.shape)} must divide evenly over {n} ranks")
        piece = tensor.shape[0] // n
        self.ledger.record(kind, (n - 1) * _nbytes(tensor) // n, (n - 1) * _nbytes(tensor) // n)
        total = self._meet(f"reduce_scatter {tuple(tensor.shape)}", tensor, lambda vs: _reduce(op, vs))
        return total[self._rank * piece : (self._rank + 1) * piece].clone()

    def broadcast(self, tensor: torch.Tensor, src: int, kind: str = "broadcast") -> torch.Tensor:
        if self.size > 1:
            me = self._rank
            self.ledger.record(kind, _nbytes(tensor) if me == src else 0, 0 if me == src else _nbytes(tensor))
            got = self._meet(f"broadcast {tuple(tensor.shape)} from {src}", tensor, lambda vs: vs[src].clone())
            if me != src:
                tensor.copy_(got)
        return tensor

    def all_gather_object(self, obj) -> list:
        return self._meet("all_gather_object", obj, list)

    def exchange(
        self, sends: dict[int, torch.Tensor], recv_from: list[int], like: torch.Tensor | None = None, kind: str = "p2p"
    ) -> dict[int, torch.Tensor]:
        got, wait = self.exchange_async(sends, recv_from, like, kind)
        wait()
        return got

    def exchange_async(
        self, sends: dict[int, torch.Tensor], recv_from: list[int], like: torch.Tensor | None = None, kind: str = "p2p"
    ):
        me, n = self._rank, self.size
        for p in [*sends, *recv_from]:
            if not 0 <= p < n or p == me:
                raise ValueError(f"exchange peer {p} must be another rank of this group (0..{n - 1}, not {me})")
        if like is None and recv_from and not sends:
            raise ValueError("exchange: pass like= (shape and dtype of what arrives) when sending nothing")
        self.ledger.record(
            kind,
            sum(_nbytes(t) for t in sends.values()),
            sum(_nbytes(like if like is not None else next(iter(sends.values()))) for _ in recv_from),
        )
        for p, t in sends.items():
            self.hub.post(me, p, t.detach().clone())
        got: dict[int, torch.Tensor] = {}

        def wait() -> None:
            for p in recv_from:
                if p not in got:
                    got[p] = self.hub.take(p, me)

        return got, wait

    def send(self, tensor: torch.Tensor, dst: int, kind: str = "p2p") -> None:
        self.ledger.record(kind, _nbytes(tensor), 0)
        self.hub.post(self._rank, dst, tensor.detach().clone())

    def recv(self, tensor: torch.Tensor, src: int, kind: str = "p2p") -> torch.Tensor:
        self.ledger.record(kind, 0, _nbytes(tensor))
        return tensor.copy_(self.hub.take(src, self._rank))


# ---- the simulation --------------------------------------------------------------------------------------
def current_island() -> int | None:
    """The island whose `main` this thread runs inside `run`, or None outside a simulation: what code that asks
    torch.distributed for its rank (rank 0 writes a file) asks instead, since every island shares the process."""
    return getattr(_THREAD, "island", None)


def worlds(islands: int, device: str | torch.device = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> list[World]:
    """The M Worlds of a simulation, one per island (one worker each), sharing the hubs. Use them through
    `run`, which gives each its thread and turn; alone they are for code that drives the islands itself."""
    return _simulation(islands, device, timeout_s)[0]


def _simulation(
    islands: int, device: str | torch.device, timeout_s: float
) -> tuple[list[World], _Turns, dict[str, _Hub]]:
    """`worlds`, with the turns and hubs they share (what `run` drives)."""
    if isinstance(islands, bool) or not isinstance(islands, int) or islands < 1:
        raise ValueError(f"islands must be an integer >= 1; got {islands!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0; got {timeout_s}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is visible; use device='cpu'")
    turns = _Turns(islands, dev)
    hubs = {scope: _Hub(islands, turns, timeout_s) for scope in ("global", "cross")}
    out = []
    for i in range(islands):
        ledger = CommLedger()
        world = World(
            rank=i,
            size=islands,
            islands=islands,
            device=dev,
            backend="simulated",
            ledger=ledger,
            comms={
                "global": SimComm(hubs["global"], i, ledger),
                "cross": SimComm(hubs["cross"], i, ledger),
                "local": LoneComm(),
            },
            data_shard=(i, islands),
        )
        out.append(world)
    return out, turns, hubs


def run(
    main: Callable[[World], Any], islands: int, device: str | torch.device = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S
) -> list:
    """main(world) on each of `islands` simulated islands (module docstring), concurrently, in this process.
    Returns main's results in island order. The first island to raise stops the others at their next
    collective; that error is re-raised here (naming the island)."""
    ws, turns, hubs = _simulation(islands, device, timeout_s)
    results: list = [None] * islands
    errors: list = [None] * islands

    def body(i: int) -> None:
        turns.local.island = _THREAD.island = i
        turns.acquire(i)
        try:
            results[i] = main(ws[i])
        except BaseException as e:  # noqa: BLE001 - carried to the caller below
            errors[i] = e
            for hub in hubs.values():
                hub.abort(e)
        finally:
            turns.release(i)
            turns.local.island = _THREAD.island = None

    if not _RUNNING.acquire(blocking=False):
        raise RuntimeError("islands.simulate.run is already running in this process; run simulations one at a time")
    # The turn passes on after every optimizer step, so no island runs more than a step ahead of the others, and
    # while an island waits on a Future (an overlapped exchange landing, Exchange.run's ordering), so it never
    # holds the turn another island needs to start the same exchange. Both hooks act only on a thread holding a
    # turn of this simulation; they are removed when it ends.
    hook = register_optimizer_step_post_hook(lambda *args: turns.yield_turn())
    result = Future.result

    def waiting(self, timeout=None):
        if turns.mine() is None:
            return result(self, timeout)
        with turns.blocking():
            return result(self, timeout)

    Future.result = waiting  # type: ignore[method-assign]  # patched for the run, put back in the finally below
    threads = [threading.Thread(target=body, args=(i,), name=f"islands-sim-{i}", daemon=True) for i in range(islands)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        Future.result = result  # type: ignore[method-assign]  # the original, put back
        hook.remove()
        _RUNNING.release()
    first = next(
        (i for i, e in enumerate(errors) if e is not None and not isinstance(e, SimulationAborted)),
        next((i for i, e in enumerate(errors) if e is not None), None),
    )
    if first is not None:
        raise RuntimeError(f"simulated island {first} of {islands} failed: {errors[first]!r}") from errors[first]
    return results
