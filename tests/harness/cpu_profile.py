"""A pytest plugin that records each test's CPU time, its processes' included.

Wall time (``--durations``) says little on a loaded 2-core machine; CPU seconds do not depend on the load, so
they say which tests to make cheaper to keep ``make test`` within its budget. Enable it with
``-p harness.cpu_profile`` and ``ISLANDS_CPU_PROFILE=<file>``; each line is ``cpu_s<TAB>wall_s<TAB>nodeid``
(xdist workers append to the same file).

Processes a test starts are not always this process's children to reap (a fork server's copies are the
server's), so rusage misses them. With ``ISLANDS_CPU_CGROUP=<a cgroup v1 cpuacct directory>`` (root only) each
pytest process moves into a cgroup of its own below it, and a test's CPU is its cgroup's usage: every process
it started, whoever reaps it.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Generator
from pathlib import Path

import pytest


def _rusage_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _cgroup_clock(root: str) -> Callable[[], float]:
    group = Path(root) / os.environ.get("PYTEST_XDIST_WORKER", "main")
    group.mkdir(exist_ok=True)
    (group / "cgroup.procs").write_text(str(os.getpid()))  # this process; what it starts from now on follows
    usage = group / "cpuacct.usage"
    return lambda: int(usage.read_text()) / 1e9


_clock: Callable[[], float] = _rusage_seconds


def pytest_configure(config: pytest.Config) -> None:
    global _clock
    root = os.environ.get("ISLANDS_CPU_CGROUP")
    if root and os.environ.get("ISLANDS_CPU_PROFILE"):
        _clock = _cgroup_clock(root)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    path = os.environ.get("ISLANDS_CPU_PROFILE")
    cpu0, wall0 = _clock(), time.perf_counter()
    yield
    if path:
        line = f"{_clock() - cpu0:.2f}\t{time.perf_counter() - wall0:.2f}\t{item.nodeid}\n"
        with open(path, "a") as out:
            out.write(line)
