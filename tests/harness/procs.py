"""Ports and start methods for the tests that start rank processes."""

from __future__ import annotations

import socket

from islands.runtime.launch import spawn
from islands.tasks import heavy_imports


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Rank processes for the multi-process tests: forked from one server process that has imported torch and
# islands once, instead of spawned interpreters that import them again (2-3 s of CPU per rank on a 2-core
# machine; most of the suite's multi-process tests are that start-up). The server only imports, never runs
# a collective or a parallel region, so what its children inherit is a clean interpreter. torch._dynamo is
# imported by the first torch.optim optimizer a rank builds (~1.2 s of CPU each); torch's FSDP by every fsdp rank.
# It is the same server as the in-process launchers' (islands.runtime.launch.spawn uses multiprocessing's one
# forkserver): one per xdist process, started by whichever test comes first and kept for every later one. So the
# list is one for both, set for the launchers too (tests/conftest.py: spawn.preload), and holds the heavy imports
# of the jobs that run in it: a job's own preload() comes too late for a server started already, and every rank
# of a transformers model (the gpt2 and llama ranks of the elastic and frontier tests; a user's task file has no
# preload of its own) imported transformers' model base itself, ~2.7 CPU-s each.
FORKSERVER_PRELOAD = list(
    dict.fromkeys(
        [
            *spawn.PRELOAD,
            "torch.distributed.fsdp",
            "islands",
            "islands.runtime.world",
            "islands.app.build",
            *heavy_imports("hf-causal-lm"),
        ]
    )
)


def mp_context():
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def forkserver() -> str:
    """The start method for torch.multiprocessing.start_processes, with the preload above in place."""
    mp_context()
    return "forkserver"
