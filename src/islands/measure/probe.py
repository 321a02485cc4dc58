"""Interconnect probe run at job start: how the ranks are connected, point-to-point latency and bandwidth,
all-reduce bus bandwidth.

Bus bandwidth follows nccl-tests: algorithm bandwidth (bytes / time) times 2(n-1)/n for all-reduce,
so the number is comparable to the per-link rate whatever the world size. Probe traffic is not part of
the training ledger; it is reported on its own.

How the ranks are connected is observed, never assumed: each rank records its hostname, its network
namespace and the local address the kernel picks to reach MASTER_ADDR, and ranks sharing all three are
one host. Only one host reached over a loopback address is called loopback; two testbed namespaces on
one machine, or two machines, are a network.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from islands.runtime.comm import Comm, CommLedger
from islands.runtime.world import World

P2P_BYTES = 4 << 20
ALLREDUCE_BYTES = (256 << 10, 4 << 20)


def _default_group_device(world: World) -> torch.device:
    """Where the default group's tensors live: the world's device on NCCL, else the CPU (a gloo world whose islands
    share GPUs trains on CUDA, and gloo's point-to-point takes host tensors)."""
    return world.device if world.backend == "nccl" else torch.device("cpu")


def _peer(world: World) -> int:
    # With several islands the interesting link is the one between islands.
    return world.workers_per_island if world.islands > 1 else 1


def probe_p2p(world: World, reps: int = 3, pings: int = 10) -> dict:
    a, b = 0, _peer(world)
    me = world.rank
    device = _default_group_device(world)
    small = torch.zeros(1, device=device)
    big = torch.zeros(P2P_BYTES // 4, device=device)
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
        t = torch.ones(size // 4, device=_default_group_device(world))
        dist.all_reduce(t)  # warm-up: connection set-up is not bandwidth
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(t)
        sec = (time.perf_counter() - start) / reps
        algbw = size / sec
        out.append(
            {"bytes": size, "seconds": sec, "algbw_gb_s": algbw / 1e9, "busbw_gb_s": algbw * 2 * (n - 1) / n / 1e9}
        )
    return out


# ---- how the ranks are connected ------------------------------------------------------------
def local_address_towards(host: str, port: int = 9) -> str | None:
    """The local address this process would use to reach `host`: a UDP socket's connect() only picks the
    route and source address, it sends no packet. None when `host` does not resolve or is unreachable."""
    if not host:
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.connect(address)
            return s.getsockname()[0]
    except OSError:
        return None


def _netns() -> str:
    try:
        return os.readlink("/proc/self/ns/net")  # 'net:[4026531840]': differs between testbed hosts
    except OSError:
        return ""


def connection_facts() -> dict:
    """This rank's side of the topology: who it is and how it reaches the rendezvous host."""
    return {
        "hostname": socket.gethostname(),
        "netns": _netns(),
        "local_addr": local_address_towards(os.environ.get("MASTER_ADDR", "")),
        "socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME", ""),
    }


def is_loopback(address: str | None) -> bool:
    if not address:
        return False
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def topology(master_addr: str, ranks: list[dict]) -> dict:
    """Hosts among the ranks (same hostname, network namespace and local address) and whether the job is
    one host talking to itself over loopback."""
    hosts = {(r.get("hostname"), r.get("netns"), r.get("local_addr")) for r in ranks}
    loopback = len(hosts) == 1 and all(is_loopback(r.get("local_addr")) for r in ranks)
    return {"master_addr": master_addr, "hosts": len(hosts), "loopback": loopback, "ranks": ranks}


def probe_topology() -> dict:
    """Every rank's connection_facts, gathered (a collective: every rank calls it)."""
    ranks: list[Any] = [None] * dist.get_world_size()  # all_gather_object fills in every rank's dict
    dist.all_gather_object(ranks, connection_facts())
    return topology(os.environ.get("MASTER_ADDR", ""), ranks)


def probe_cross(world: World, reps: int = 3) -> dict:
    """The cross-island group as the outer strategy meets it: an all-reduce of ALLREDUCE_BYTES[-1] over
    world's cross group (through host buffers where a GPU job crosses on gloo, as its strategy's exchanges do),
    counted in a ledger of its own (probe traffic is not training traffic). Every rank calls it; each times its
    own group."""
    timed = world.across(Comm(world.cross_group, CommLedger()))
    n = timed.size
    size = ALLREDUCE_BYTES[-1]
    t = torch.ones(size // 4, device=world.device)
    timed.all_reduce(t, kind="probe")  # warm-up: connection set-up is not bandwidth
    start = time.perf_counter()
    for _ in range(reps):
        timed.all_reduce(t, kind="probe")
    sec = (time.perf_counter() - start) / reps
    algbw = size / sec
    return {
        "backend": world.cross_backend or world.backend,
        "staged_through_host": world.crosses_through_host,
        "ranks": n,
        "bytes": size,
        "seconds": sec,
        "busbw_gb_s": algbw * 2 * (n - 1) / n / 1e9 if n > 1 else 0.0,
    }


def probe_interconnect(world: World) -> dict:
    if not world.distributed:
        return {"measured": False, "reason": "single process: no interconnect"}
    t = time.perf_counter()
    topo = probe_topology()
    p2p = probe_p2p(world)
    ar = probe_all_reduce(world)
    record = {
        "measured": True,
        "backend": world.backend,
        "local_backend": world.local_backend or world.backend,
        "cross_backend": world.cross_backend or world.backend,
        "topology": topo,
        "p2p": p2p,
        "all_reduce": ar,
    }
    if world.islands > 1 and world.cross_group is not None:
        record["cross"] = probe_cross(world)
    record["probe_seconds"] = time.perf_counter() - t
    return record


def link_name(interconnect: dict) -> str:
    """What the ranks talked over: the testbed when one is known, else what the topology shows."""
    rate = interconnect.get("testbed", {}).get("rate")
    if rate:
        return f"testbed {rate}"
    backend = interconnect.get("backend", "?")
    topo = interconnect.get("topology")
    if not topo:
        return f"{backend}, link not recorded"
    if topo["hosts"] > 1:
        return f"{backend} network ({topo['hosts']} hosts)"
    if topo["loopback"]:
        return f"{backend} loopback"
    via = next((r["local_addr"] for r in topo.get("ranks", []) if r.get("local_addr")), None)
    return f"{backend} on one host" + (f" (via {via})" if via else "")


def describe(interconnect: dict) -> str:
    """One line naming the measured link, for tables and plots."""
    if not interconnect.get("measured"):
        return interconnect.get("reason") or "none (single process)"
    p = interconnect.get("p2p", {})
    ar = interconnect.get("all_reduce", [{}])[-1]
    line = (
        f"{link_name(interconnect)}: p2p {p.get('bandwidth_gbit_s', 0):.2f} Gbit/s, "
        f"{p.get('latency_us', 0):.0f} us; all-reduce busbw {ar.get('busbw_gb_s', 0):.3f} GB/s"
    )
    cross = interconnect.get("cross_backend")
    if cross and cross != interconnect.get("backend"):  # a GPU job crossing islands on gloo says so
        busbw = interconnect.get("cross", {}).get("busbw_gb_s")
        line += f"; across islands {cross}" + (f" {busbw:.3f} GB/s" if busbw is not None else "")
    return line
