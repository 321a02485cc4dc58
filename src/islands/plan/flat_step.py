"""A flat strategy's own local work per step, measured: what a DDP, ZeRO-1 or FSDP step costs a worker beyond the
plain step and beyond the exposed collective time the cost model gives it (DDP's bucket copies and hooks, ZeRO-1's
partitioned optimizer step and parameter copies, FSDP's per-unit hooks, its copies into and out of the gathered
buffers, its optimizer step on sharded parameters, its clipping norm over shards).

On a CPU this work is not small against a small model's step: the transformers llama of planner-accuracy (164K
parameters, 2 blocks) takes ~14 ms a plain step and ~42 ms an FSDP step between two processes on loopback, of which
the collectives' wire time is ~4 ms. The profile of one worker (islands.plan.profile) runs none of it (a world of
one has no group), so it is measured here the only way it shows: two gloo processes on this machine run the job's
step under the strategy and, in the same processes, its plain step, alternating chunks of steps so both meet the
same load. The median of the paired per-step differences, less what the cost model predicts for the strategy's
collectives and synchronisation between 2 workers on the loopback probe's link, is the local work the planner adds
to the strategy's step on any link (islands.plan.api.Profiler.local_work).
"""

from __future__ import annotations

import copy
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from islands.app.build import build_inner, build_task
from islands.config import JobConfig
from islands.plan.job import job_trainer
from islands.runtime.world import World
from islands.sync.base import Strategy
from islands.sync.sharded import FSDP
from islands.sync.stack import Stack
from islands.sync.wrap_policy import BlockWrap

CHUNK = 8  # steps of each kind per chunk: a few ms-long steps timed together, one preemption moves less
CHUNKS = 5  # paired chunks after one of warm-up
PROCESSES = 2  # the smallest group that shards: FSDP of a group of one gathers and scatters nothing


def _timed(step: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t0) / n


def _worker(rank: int, init: str, cfg: JobConfig, kind: str, threads: int, out: str) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=PROCESSES)
    try:
        with torch.random.fork_rng():
            task = build_task(cfg)  # `cfg`: the profiler's one-island job, each worker's share of the batch
        world = World(rank=rank, size=PROCESSES, islands=1, device=torch.device("cpu"), backend="gloo")
        world.mesh = init_device_mesh("cpu", (1, PROCESSES), mesh_dim_names=("island", "local"))
        if kind == "fsdp":  # the planner's candidate: one unit per block, resharded after forward (plan.api)
            inner: Strategy = FSDP(wrap=BlockWrap(), reshard_after_forward=True, grad_clip=cfg.train.grad_clip > 0)
        else:
            job = copy.deepcopy(cfg)
            job.inner.strategy = kind
            inner = build_inner(job, world, task)
        flat = job_trainer(cfg, task, world, Stack(inner))
        plain = job_trainer(cfg, task, World.single())
        diffs = []
        for i in range(CHUNKS + 1):
            a = _timed(flat.train_step, CHUNK)
            b = _timed(plain.train_step, CHUNK)
            if i:  # the first pair warms both up
                diffs.append(a - b)
        if rank == 0:
            torch.save(diffs, out)
    finally:
        dist.destroy_process_group()


FLAT = ("ddp", "zero1", "fsdp")


def flat_step_extra(cfg: JobConfig, kind: str, threads: int = 1) -> float:
    """Median seconds a step of `cfg`'s job under the flat strategy `kind` (one of FLAT) costs a worker beyond its
    plain step, collectives included, between two gloo processes on this machine (module docstring)."""
    if kind not in FLAT:
        raise ValueError(f"flat strategy {kind!r}: one of {', '.join(FLAT)}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "flat.pt")
        mp.spawn(_worker, args=(f"tcp://127.0.0.1:{port}", cfg, kind, threads, out), nprocs=PROCESSES, join=True)
        return statistics.median(torch.load(out))
