"""pytest plugin: each xdist worker (and everything it starts) in a cpuacct cgroup of its own; per-test CPU
(usage delta, children included) written to $CGCPU_OUT/<worker>.tsv."""
import os, time
from pathlib import Path

_cg = None
_out = None
_t0 = {}

def pytest_configure(config):
    global _cg, _out
    wid = os.environ.get("PYTEST_XDIST_WORKER")
    if not wid:
        return
    _cg = Path(f"/sys/fs/cgroup/cpuacct/cgtest_{wid}_{os.getpid()}")
    _cg.mkdir(exist_ok=True)
    (_cg / "cgroup.procs").write_text(str(os.getpid()))
    _out = open(Path(os.environ["CGCPU_OUT"]) / f"{wid}.tsv", "a", buffering=1)

def _usage():
    return int((_cg / "cpuacct.usage").read_text()) / 1e9

def pytest_runtest_setup(item):
    if _cg: _t0[item.nodeid] = (_usage(), time.perf_counter())

def pytest_runtest_teardown(item, nextitem):
    pass

def pytest_runtest_logfinish(nodeid, location):
    if _cg and nodeid in _t0:
        u, t = _t0.pop(nodeid)
        _out.write(f"{_usage()-u:.2f}\t{time.perf_counter()-t:.2f}\t{nodeid}\n")
