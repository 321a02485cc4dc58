"""Interconnect probe run at job start: point-to-point latency and bandwidth, all-reduce bus bandwidth.

Bus bandwidth follows nccl-tests: algorithm bandwidth (bytes / time) times 2(n-1)/n for all-reduce,
so the number is comparable to the per-link rate whatever the world size. Probe traffic is not part of
the training ledger; it is reported on its own.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from islands.runtime.world import World

P2P_BYTES = 4 << 20
ALLREDUCE_BYTES = (256 << 10, 4 << 20)


def _peer(world: World) -> int:
    # With several islands the interesting link is the one between islands.
    return world.workers_per_island if world.islands > 1 else 1


def probe_p2p(world: World, reps: int = 3, pings: int = 10) -> dict:
    a, b = 0, _peer(world)
    me = world.rank
    small = torch.zeros(1, device=world.device)
    big = torch.zeros(P2P_BYTES // 4, device=world.device)
    rtts, secs = [], []
    dist.barrier()
    if me in (a, b):
        other = b if me == a else a
        for _ in range(pings):
            t = time.perf_counter()
            if me == a:
                dist.send(small, other)
                dist.recv(small, other)
            else:
                dist.recv(small, other)
                dist.send(small, other)
            rtts.append(time.perf_counter() - t)
        for _ in range(reps):
            t = time.perf_counter()
            if me == a:
                dist.send(big, other)
                dist.recv(small, other)  # acknowledgement: the transfer has landed
            else:
                dist.recv(big, other)
                dist.send(small, other)
            secs.append(time.perf_counter() - t)
    dist.barrier()
    if me != a:
        return {}
    latency = statistics.median(rtts) / 2
    # Each timed transfer includes one acknowledgement; on a loaded machine the ping estimate can
    # exceed that, so never subtract more than half the transfer.
    transfer = max(min(secs) - latency, min(secs) / 2)
    return {
        "pair": [a, b],
        "latency_us": latency * 1e6,
        "bandwidth_gbit_s": P2P_BYTES * 8 / transfer / 1e9,
        "bytes": P2P_BYTES,
    }


def probe_all_reduce(world: World, reps: int = 3) -> list[dict]:
    n = world.size
    out = []
    for size in ALLREDUCE_BYTES:
        t = torch.ones(size // 4, device=world.device)
        dist.all_reduce(t)  # warm-up: connection set-up is not bandwidth
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(t)
        sec = (time.perf_counter() - start) / reps
        algbw = size / sec
        out.append({"bytes": size, "seconds": sec, "algbw_gb_s": algbw / 1e9,
                    "busbw_gb_s": algbw * 2 * (n - 1) / n / 1e9})
    return out


def probe_interconnect(world: World) -> dict:
    if not world.distributed:
        return {"measured": False, "reason": "single process: no interconnect"}
    t = time.perf_counter()
    p2p = probe_p2p(world)
    ar = probe_all_reduce(world)
    return {"measured": True, "backend": world.backend, "p2p": p2p, "all_reduce": ar,
            "probe_seconds": time.perf_counter() - t}


def describe(interconnect: dict) -> str:
    """One line naming the measured link, for tables and plots."""
    if not interconnect.get("measured"):
        return "none (single process)"
    p = interconnect.get("p2p", {})
    ar = interconnect.get("all_reduce", [{}])[-1]
    where = interconnect.get("testbed", {}).get("rate")
    name = f"testbed {where}" if where else interconnect.get("backend", "?") + " loopback"
    return (f"{name}: p2p {p.get('bandwidth_gbit_s', 0):.2f} Gbit/s, {p.get('latency_us', 0):.0f} us; "
            f"all-reduce busbw {ar.get('busbw_gb_s', 0):.3f} GB/s")
