import os
import sys
from pathlib import Path

import pytest

# Helpers live in the harness package (tests/harness); the names stay here for code that still imports them
# from conftest, but tests import them from harness.procs.
from harness.procs import FORKSERVER_PRELOAD, forkserver, free_port, mp_context  # noqa: F401
from islands.runtime.launch import spawn

# A few test files import another's helpers by its module name (`from test_checkpoint_resume import same`), as
# they did when tests/ was one flat folder: every folder of test files is on sys.path before any is collected, so
# such an import does not depend on the order pytest collects the folders in. (Test file names stay unique.)
for _folder in sorted({p.parent for p in Path(__file__).resolve().parent.glob("*/*/test_*.py")}):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))


@pytest.fixture
def dist_env(monkeypatch):
    """Set torch's env:// variables for a spawned group on a free loopback port."""

    def make(world_size: int) -> dict:
        return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size)}

    return make


def pytest_configure(config):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the in-process launchers' fork server preloads what the tests' own does (harness.procs: it is one server)
    spawn.preload(FORKSERVER_PRELOAD)


# Every test under tests/integration starts processes (ranks, a launcher, the CLI as a subprocess, a fork server) or
# runs long: it is marked `integration` here, by its path, so `-m "not integration"` leaves the quick lane
# (tests/unit, `make test-fast`). A process-starting test outside tests/ (bench/tests) carries the mark itself.
INTEGRATION = Path(__file__).resolve().parent / "integration"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the group marks into the test ids
def pytest_collection_modifyitems(config, items):
    """`make test` spreads tests over processes (pytest-xdist, --dist loadgroup): the tests of a file whose fixtures
    live for the whole module (a gloo world run once, its results asserted by many tests) stay in one process, so
    that world runs once; every other test goes wherever a process is free. (Run after xdist's hook, as this was
    until 2026-12-02, the marks grouped nothing: such fixtures ran once per process.)"""
    for item in items:
        if INTEGRATION in item.path.resolve().parents:
            item.add_marker(pytest.mark.integration)
        info = getattr(item, "_fixtureinfo", None)
        defs = [d for ds in (info.name2fixturedefs.values() if info else ()) for d in ds]
        if any(d.scope in ("module", "session") and d.baseid.endswith(".py") for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
