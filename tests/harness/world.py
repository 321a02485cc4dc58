"""Start N spawned ranks that each report once through a queue, and collect the reports.

Shared by the multi-process strategy tests. A worker is called as `worker(rank, env, queue, *args)`:
`env` holds torch's env:// rendezvous (MASTER_ADDR, MASTER_PORT on a free loopback port, WORLD_SIZE,
one thread per rank) for the worker to put into os.environ, and the worker puts one tuple whose first
item is its rank. Reports come back sorted by rank. A rank that dies, or a world that does not report
within `timeout` seconds, fails at once with the exit codes instead of hanging; the ranks still alive then print
their threads' Python stacks to stderr first (faulthandler), so a CI log shows where they hung.
"""

from __future__ import annotations

import faulthandler
import os
import queue as queue_mod
import signal
import time

import torch.distributed as dist

from harness.procs import free_port, mp_context
from islands.runtime.world import GIL_HANDOFF_S


def spawn_ranks(worker, n: int, *args, timeout: float = 150.0) -> list[tuple]:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(n), "OMP_NUM_THREADS": "1"}
    ctx = mp_context()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_traced, args=(worker, r, env, queue, *args)) for r in range(n)]
    for p in procs:
        p.start()
    got, deadline = [], time.monotonic() + timeout
    try:
        while len(got) < n:
            if time.monotonic() > deadline:
                _dump_stacks(procs)
                raise TimeoutError(f"only ranks {sorted(r[0] for r in got)} of {n} reported within {timeout} s")
            try:
                got.append(queue.get(timeout=2))
            except queue_mod.Empty:
                dead = {i: p.exitcode for i, p in enumerate(procs) if p.exitcode not in (None, 0)}
                if dead:
                    raise RuntimeError(f"rank(s) died before reporting (exit codes {dead})") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    codes = [p.exitcode for p in procs]
    assert all(c == 0 for c in codes), f"exit codes {codes}"
    return sorted(got, key=lambda r: r[0])


def _traced(worker, *args) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    worker(*args)


def _dump_stacks(procs) -> None:
    """Ask every rank still alive for its stacks (_traced's handler) and give them a moment to print."""
    alive = [p for p in procs if p.is_alive() and p.pid is not None]
    for p in alive:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    if alive:
        time.sleep(1.0)


def leave_group() -> None:
    """A rank's end of its default process group, as close_world ends it: the GIL handed off (gloo's worker threads
    free the last collective's tensors under it), then the group destroyed. Drop every torch DDP wrapper first: its
    reducer holds the group, and a group whose last owner is a reducer is destroyed with the GIL held, joining a
    gloo thread that may still wait for the GIL (a deadlock: session 38's CI, test_ddp_start; sessions 28-29,
    test_compress_integration)."""
    time.sleep(GIL_HANDOFF_S)
    dist.destroy_process_group()
