import os
import socket

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def dist_env(monkeypatch):
    """Set torch's env:// variables for a spawned group on a free loopback port."""

    def make(world_size: int) -> dict:
        return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size)}

    return make


def pytest_configure(config):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the group marks into the test ids
def pytest_collection_modifyitems(config, items):
    """`make test` spreads tests over processes (pytest-xdist, --dist loadgroup): the tests of a file whose fixtures
    live for the whole module (a gloo world run once, its results asserted by many tests) stay in one process, so
    that world runs once; every other test goes wherever a process is free. (Run after xdist's hook, as this was
    until 2026-12-02, the marks grouped nothing: such fixtures ran once per process.)"""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = [d for ds in (info.name2fixturedefs.values() if info else ()) for d in ds]
        if any(d.scope in ("module", "session") and d.baseid.endswith(".py") for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


# Rank processes for the multi-process tests: forked from one server process that has imported torch and
# islands once, instead of spawned interpreters that import them again (2-3 s of CPU per rank on a 2-core
# machine; most of the suite's multi-process tests are that start-up). The server only imports, never runs
# a collective or a parallel region, so what its children inherit is a clean interpreter.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "numpy", "islands", "islands.runtime.world", "islands.app.build"]


def mp_context():
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def forkserver() -> str:
    """The start method for torch.multiprocessing.start_processes, with the preload above in place."""
    mp_context()
    return "forkserver"
