"""cgcpu plus each test's start time (epoch), and the worker's collection CPU."""
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
    _out.write(f"{_usage():.2f}\t0\t{time.time():.2f}\tCONFIGURE\n")

def pytest_collection_finish(session):
    if _cg: _out.write(f"{_usage():.2f}\t0\t{time.time():.2f}\tCOLLECTED\n")

def _usage():
    return int((_cg / "cpuacct.usage").read_text()) / 1e9

def pytest_runtest_setup(item):
    if _cg: _t0[item.nodeid] = (_usage(), time.perf_counter(), time.time())

def pytest_runtest_logfinish(nodeid, location):
    if _cg and nodeid in _t0:
        u, t, s = _t0.pop(nodeid)
        _out.write(f"{_usage()-u:.2f}\t{time.perf_counter()-t:.2f}\t{s:.2f}\t{nodeid}\n")

def pytest_unconfigure(config):
    if _cg: _out.write(f"{_usage():.2f}\t0\t{time.time():.2f}\tEND\n")
