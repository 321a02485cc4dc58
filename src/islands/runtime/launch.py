"""Start the workers of one job on this machine (or inside testbed hosts) and watch them.

Each worker is a plain process joining through torch's env:// rendezvous, exactly as under torchrun,
so the same worker code runs in both. The launcher's only job is supervision: if any worker exits
non-zero or is killed, the others are stopped at once, the failed rank's error is shown, and the job
exits non-zero. Workers blocked in a collective are additionally bounded by the collective timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from islands.config import TrainConfig, dump_json

GRACE_SECONDS = 5.0


class LaunchError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


@dataclass
class WorkerProcess:
    rank: int
    proc: subprocess.Popen
    log: Path


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop_all(workers: list[WorkerProcess]) -> None:
    for w in workers:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for w in workers:
        try:
            w.proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def launch(cfg: TrainConfig, run_dir: Path, out=sys.stderr) -> int:
    """Run the job; returns the exit code the CLI should use (0 on success)."""
    if cfg.elastic:  # workers may die and join: islands.runtime.elastic_launch (docs/membership.md)
        from islands.runtime.elastic_launch import launch_elastic

        return launch_elastic(cfg, run_dir, out)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    cfg_path = run_dir / "config.json"
    dump_json(cfg, cfg_path)
    testbed = None
    master = "127.0.0.1"
    if cfg.testbed:
        from islands.testbed import Testbed

        testbed = Testbed.load(cfg.testbed)
        master = testbed.master_addr
        port = testbed.free_port(0)
    elif cfg.port:
        if not port_is_free(cfg.port):
            raise LaunchError(f"port {cfg.port} is busy on 127.0.0.1; choose another or use port=0 to pick a free one")
        port = cfg.port
    else:
        port = free_port()
    workers: list[WorkerProcess] = []
    try:
        for rank in range(cfg.workers):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(cfg.workers), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(cfg.workers),
                       MASTER_ADDR=master, MASTER_PORT=str(port), PYTHONUNBUFFERED="1",
                       OMP_NUM_THREADS=str(cfg.threads))
            argv = [sys.executable, "-m", "islands.runtime.worker", str(cfg_path), str(run_dir)]
            if testbed is not None:
                host = testbed.host_for_rank(rank)
                argv = testbed.wrap(host, argv)
                env.update(testbed.env(host))
            log = run_dir / "logs" / f"rank{rank}.log"
            stdout = None if rank == 0 else open(log, "w")
            stderr = open(log, "w") if rank == 0 else subprocess.STDOUT
            proc = subprocess.Popen(argv, env=env, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
            workers.append(WorkerProcess(rank, proc, log))
        before = _wire_counters(testbed)
        code = _supervise(workers, out)
        if code == 0 and testbed is not None:
            _record_wire_bytes(run_dir, testbed, before)
        return code
    except KeyboardInterrupt:
        print("interrupted: stopping all workers", file=out)
        return 130
    finally:
        _stop_all(workers)


def _wire_counters(testbed) -> list[tuple[int, int]] | None:
    if testbed is None:
        return None
    from islands.testbed import wire_bytes

    return [wire_bytes(testbed, h.index) for h in testbed.hosts]


def _record_wire_bytes(run_dir: Path, testbed, before) -> None:
    """Bytes the shaped links really carried (headers included), next to the ledger's payload count."""
    import json

    after = _wire_counters(testbed)
    path = run_dir / "run.json"
    if not path.exists():
        return
    rec = json.loads(path.read_text())
    rec["interconnect"]["wire_bytes_per_host"] = [
        {"host": i, "tx": a[0] - b[0], "rx": a[1] - b[1]} for i, (a, b) in enumerate(zip(after, before))]
    path.write_text(json.dumps(rec, indent=2, default=str))


def _supervise(workers: list[WorkerProcess], out) -> int:
    while True:
        codes = {w.rank: w.proc.poll() for w in workers}
        failed = [w for w in workers if codes[w.rank] not in (None, 0)]
        if failed:
            first = failed[0]
            code = codes[first.rank]
            _stop_all(workers)
            print(f"\nislands: worker rank {first.rank} failed ({describe_exit(code)}); stopped the other workers.",
                  file=out)
            print(f"--- last lines of rank {first.rank}'s log ({first.log}) ---\n{_tail(first.log)}", file=out)
            return 1
        if all(c == 0 for c in codes.values()):
            return 0
        time.sleep(0.1)
