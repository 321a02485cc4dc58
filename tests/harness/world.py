"""Start N spawned ranks that each report once through a queue, and collect the reports.

Shared by the multi-process strategy tests. A worker is called as `worker(rank, env, queue, *args)`:
`env` holds torch's env:// rendezvous (MASTER_ADDR, MASTER_PORT on a free loopback port, WORLD_SIZE,
one thread per rank) for the worker to put into os.environ, and the worker puts one tuple whose first
item is its rank. Reports come back sorted by rank. A rank that dies, or a world that does not report
within `timeout` seconds, fails at once with the exit codes instead of hanging.
"""

from __future__ import annotations

import queue as queue_mod
import time

from harness.procs import free_port, mp_context


def spawn_ranks(worker, n: int, *args, timeout: float = 150.0) -> list[tuple]:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(n), "OMP_NUM_THREADS": "1"}
    ctx = mp_context()
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, env, queue, *args)) for r in range(n)]
    for p in procs:
        p.start()
    got, deadline = [], time.monotonic() + timeout
    try:
        while len(got) < n:
            if time.monotonic() > deadline:
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
