"""The launcher of an elastic job: host the store, run the coordinator, start and watch the workers.

Policy (docs/membership.md): the launcher, not a worker, hosts the TCPStore, so any worker may die.
A worker that exits is reported dead in the store at once (so survivors need not wait for its
heartbeat to go stale) and the job carries on. The job ends when none of its own workers is still
running and no member of the newest epoch is alive (joiners started elsewhere included, up to their
heartbeat timeout). It succeeds (exit 0) if at least one worker finished training; the launcher
itself is the single point of failure: if it dies, workers lose the store and exit with an error.
The token comes from ISLANDS_TOKEN or is generated and written to RUN_DIR/token (mode 0600); it is
never printed.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from islands.runtime.launch import LaunchError, WorkerProcess, describe_exit, log_tail, port_is_free, stop_all
from islands.runtime.membership import Coordinator, Liveness, get_json, host_store


def job_token(run_dir: Path, out) -> str:
    token = os.environ.get("ISLANDS_TOKEN", "")
    if token:
        return token
    token = secrets.token_hex(16)
    path = run_dir / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    print(f"islands: elastic job token written to {path} (mode 0600)", file=out)
    return token


def launch_elastic_workers(worker_argv: list[str], workers: int, config_json: str, run_dir: Path, *, port: int = 0,
                           threads: int = 1, heartbeat_timeout: float, out=sys.stderr, on_started=None) -> int:
    """Run an elastic job of `workers` workers, each `worker_argv + [HOST:PORT, RUN_DIR]` (the app layer names
    its elastic worker); `config_json` is what every worker (joiners included) reads from the store
    (islands.app.launch.shared_config). `on_started(address, workers, coordinator)` lets experiments inject
    faults."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    if port and not port_is_free(port, "0.0.0.0"):
        raise LaunchError(f"port {port} is busy; choose another or use port=0 to pick a free one")
    token = job_token(run_dir, out)
    server, store = host_store(port)
    address = f"127.0.0.1:{server.port}"
    coordinator = Coordinator(store, token, workers, config_json,
                              log=lambda line: print(line, file=out, flush=True)).start()
    print(f"islands: elastic job at {address}; join with `islands join {address} --token-file PATH`", file=out)
    started: list[WorkerProcess] = []
    try:
        for rank in range(workers):
            name = f"w{rank}"
            env = dict(os.environ, ISLANDS_TOKEN=token, ISLANDS_NAME=name, PYTHONUNBUFFERED="1",
                       OMP_NUM_THREADS=str(threads))
            log = run_dir / "logs" / f"{name}.log"
            with open(log, "w") as f:
                proc = subprocess.Popen([*worker_argv, address, str(run_dir)],
                                        env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            started.append(WorkerProcess(rank, proc, log))
        if on_started is not None:
            on_started(address, started, coordinator)
        return _supervise(started, store, coordinator, heartbeat_timeout, out)
    except KeyboardInterrupt:
        print("interrupted: stopping all workers", file=out)
        return 130
    finally:
        stop_all(started)
        coordinator.stop()
        del server


def _supervise(workers: list[WorkerProcess], store, coordinator: Coordinator, heartbeat_timeout: float,
               out) -> int:
    reported: set[int] = set()
    liveness = Liveness(store, heartbeat_timeout)
    while True:
        for w in workers:
            code = w.proc.poll()
            if code is None or w.rank in reported:
                continue
            reported.add(w.rank)
            coordinator.store.set(f"dead/w{w.rank}", "finished" if code == 0 else describe_exit(code))
            if code != 0:
                print(f"islands: worker w{w.rank} left ({describe_exit(code)}); the others carry on", file=out)
        if len(reported) == len(workers) and _no_member_alive(store, liveness):
            break
        time.sleep(0.05)
    finished = [w for w in workers if w.proc.returncode == 0]
    if finished:
        return 0
    first = workers[0]
    print(f"\nislands: every worker failed; last lines of {first.log}:\n{log_tail(first.log)}", file=out)
    return 1


def _no_member_alive(store, liveness: Liveness) -> bool:
    latest = int(store.get("latest")) if store.check(["latest"]) else 0
    names = [m[1] for m in get_json(store, f"e/{latest}/members", [])]
    return len(liveness.gone(names)) == len(names)
