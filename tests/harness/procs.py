"""Ports and start methods for the tests that start rank processes."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Rank processes for the multi-process tests: forked from one server process that has imported torch and
# islands once, instead of spawned interpreters that import them again (2-3 s of CPU per rank on a 2-core
# machine; most of the suite's multi-process tests are that start-up). The server only imports, never runs
# a collective or a parallel region, so what its children inherit is a clean interpreter. torch._dynamo is
# imported by the first torch.optim optimizer a rank builds (~1.2 s of CPU each); torch's FSDP by every fsdp rank.
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "numpy",
    "islands",
    "islands.runtime.world",
    "islands.app.build",
]


def mp_context():
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def forkserver() -> str:
    """The start method for torch.multiprocessing.start_processes, with the preload above in place."""
    mp_context()
    return "forkserver"
