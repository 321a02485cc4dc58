"""What the parameter server's fault tolerance costs (issue #36, part 2; docs/parameter-server.md): a push applied
in memory against one logged and fsynced first (ps_journal.DurableShard), the rebuild of a shard from its log, and
the time from a server's SIGKILL to the next push its restarted successor acknowledges (a fresh interpreter per
server, as in a job). A one-off measurement on loopback, not a benchmark:

    PYTHONPATH=src python scripts/ps_fault_timings.py [--values 1000000] [--pushes 30] [--kills 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time

import torch

from islands.sync.outer.ps import OuterRule
from islands.sync.outer.ps_journal import DurableShard, Journal
from islands.sync.outer.ps_link import Message
from islands.sync.outer.ps_remote import RemoteLink
from islands.sync.outer.ps_server import Contribution, ServerState
from islands.sync.outer.ps_service import ServiceConfig, Supervisor
from islands.sync.outer.ps_wire import PULL, PUSH


def shard(n: int, path: str | None) -> DurableShard:
    d = DurableShard(ServerState(torch.zeros(n), lambda: OuterRule()(2)), None if path is None else Journal(path))
    d.open()
    return d


def push_costs(n: int, pushes: int) -> None:
    delta, out = torch.randn(n), {}
    for name, path in (("in memory", None), ("journaled + fsync", tempfile.mkdtemp())):
        d, times = shard(n, path), []
        for i in range(pushes):
            t = time.perf_counter()
            d.push(0, 1, i + 1, Contribution(0, d.state.version, delta, 1.0), 1)
            times.append(time.perf_counter() - t)
        out[name] = statistics.median(times) * 1e3
    print(f"push of {n} fp32 values, median of {pushes}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in out.items()))
    assert path is not None
    t = time.perf_counter()
    replayed = shard(n, path).open()
    print(f"rebuild: {replayed} records replayed in {(time.perf_counter() - t) * 1e3:.0f} ms")


def recovery(kills: int) -> None:
    d = tempfile.mkdtemp()
    config = ServiceConfig(torch.zeros(1000), OuterRule("sgd", 1.0, 0.0), lease_s=2.0)
    config.save(d)
    sup = Supervisor(d).start()
    link = RemoteLink(("127.0.0.1", sup.port), 0, config.bounds, timeout_s=300, lease_s=2.0).start()
    link.send(Message(PULL, 0))
    gaps = []
    for _ in range(kills):
        link.send(Message(PUSH, 0, 0, 1.0, torch.ones(1000)))
        t = time.perf_counter()
        os.kill(sup.pid(0), signal.SIGKILL)
        link.send(Message(PUSH, 0, 0, 1.0, torch.ones(1000)))
        gaps.append(round(time.perf_counter() - t, 2))
    print(f"SIGKILL -> next push acknowledged by the restarted server: {gaps} s (restarts {sup.restarts})")
    link.close()
    sup.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--values", type=int, default=1_000_000)
    p.add_argument("--pushes", type=int, default=30)
    p.add_argument("--kills", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    push_costs(args.values, args.pushes)
    recovery(args.kills)


if __name__ == "__main__":
    main()
