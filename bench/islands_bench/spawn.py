"""Run a benchmark module as `ranks` plain env:// processes, on loopback or inside a testbed.

For micro-benchmarks that time one op rather than train (matmul-overlap, ring-attention): rank 0
writes its JSON result to `out`, which is returned. Every process gets one thread and a timeout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (the bench's own copy: islands' launcher keeps its one internal)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run_module_ranks(module: str, args: list[str], ranks: int, out: Path, bed=None, timeout: float = 900) -> dict:
    out.unlink(missing_ok=True)
    port = bed.free_port(0) if bed is not None else free_port()
    procs = []
    for rank in range(ranks):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(ranks),
            MASTER_PORT=str(port),
            MASTER_ADDR="127.0.0.1",
            OMP_NUM_THREADS="1",
        )
        argv = [sys.executable, "-m", module, str(out), *args, bed.rate if bed is not None else ""]
        if bed is not None:
            env.update(bed.env(bed.host_for_rank(rank)))
            argv = bed.wrap(bed.host_for_rank(rank), argv)
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs) or not out.exists():
        raise RuntimeError(f"{module} with {ranks} ranks failed:\n" + "\n".join(log[-3000:] for log in logs))
    return json.loads(out.read_text())


def join_world(rate: str):
    """Inside a spawned rank: the World (1 thread, env:// rendezvous) and its measured interconnect."""
    import torch

    from islands import init_world
    from islands.measure import probe_interconnect

    torch.set_num_threads(1)
    world = init_world(islands=1, timeout_s=120)
    inter = probe_interconnect(world) if world.size > 1 else {"measured": False}
    if rate:
        inter["testbed"] = {"rate": rate}
    return world, inter


def testbed_rates(ctx) -> list[str]:
    """The tbf rates a micro-benchmark runs on: --testbed-rate if given, else 1 Gbit/s (quick) or
    1 Gbit/s and 100 Mbit/s (full)."""
    if ctx.rate:
        return [ctx.rate]
    return ["1gbit"] if ctx.quick else ["1gbit", "100mbit"]


def held_bytes(fn, exclude=()) -> int:
    """Peak bytes saved for backward while fn() runs (islands.memory's exact meter; `exclude`: the
    parameters, which are not activations)."""
    from islands.memory import SavedTensorMeter

    with SavedTensorMeter(exclude=exclude) as meter:
        fn()
    return meter.peak


def time_interleaved(ops: dict, reps: int) -> dict[str, float]:
    """Median seconds per op, the ops interleaved (their order rotated every repetition, repetition 0
    a warm-up), each started together on every rank behind a barrier; the max over ranks of each
    median, since a collective op ends when its slowest rank does."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    together = dist.is_initialized() and dist.get_world_size() > 1
    names, times = list(ops), {name: [] for name in ops}
    for rep in range(reps + 1):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            if together:
                dist.barrier()
            start = time.perf_counter()
            ops[name]()
            if rep:
                times[name].append(time.perf_counter() - start)
    med = torch.tensor([statistics.median(times[name]) for name in names], dtype=torch.float64)
    if together:
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return {name: float(v) for name, v in zip(names, med)}
