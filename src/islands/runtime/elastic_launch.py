"""The launcher of an elastic job: host the store, run the coordinator, start and watch the workers.

Policy (docs/membership.md): the launcher, not a worker, hosts the TCPStore, so any worker may die.
A worker that exits is reported dead in the store at once (so survivors need not wait for its
heartbeat to go stale) and the job carries on. The job ends when none of its own workers is still
running and no member of the newest epoch is alive (joiners started elsewhere included, up to their
heartbeat timeout). It succeeds (exit 0) if at least one worker finished training; the launcher
itself is the single point of failure: if it dies, workers lose the store and exit with an error.
The token comes from ISLANDS_TOKEN or is generated and written to RUN_DIR/token (mode 0600); it is
never printed.

Every worker gets ISLANDS_ELASTIC=HOST:PORT (the store), ISLANDS_TOKEN and ISLANDS_NAME (w0, w1, ...). What
it runs is the caller's: islands' own elastic worker (`islands train --elastic`, islands.app.launch) or any
script that calls islands.init_world() (`islands run --elastic`, launch_elastic_script). The store's "job"
key (membership.JobSpec) tells a joiner what to run.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from islands.runtime.launch import LaunchError, WorkerProcess, describe_exit, log_tail, port_is_free, stop_all
from islands.runtime.membership import (ELASTIC_ENV, NAME_ENV, TOKEN_ENV, Coordinator, JobSpec, Liveness, get_json,
                                        host_store)


def job_token(run_dir: Path, out) -> str:
    token = os.environ.get(TOKEN_ENV, "")
    if token:
        return token
    token = secrets.token_hex(16)
    path = run_dir / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    print(f"islands: elastic job token written to {path} (mode 0600)", file=out)
    return token


def launch_elastic_script(argv: list[str], workers: int, run_dir: Path, *, heartbeat_timeout: float = 3.0,
                          timeout: float = 120.0, port: int = 0, threads: int = 1, out=sys.stderr,
                          on_started=None) -> int:
    """`islands run --elastic`: run `argv` (a script and its arguments) as an elastic job of `workers` workers.

    The script joins with islands.init_world() and needs an outer strategy (joins happen at its round
    boundaries). Its path is made absolute and stored with its arguments and this directory, so that `islands
    join` starts the same program anywhere. Returns the exit code (as launch_elastic_workers)."""
    if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
        raise LaunchError(f"argv must be a non-empty list of strings (the script and its arguments); got {argv!r}")
    script = Path(argv[0]).resolve()
    if not script.is_file():
        raise LaunchError(f"script {argv[0]!r} is not a file")
    try:
        job = JobSpec(workers=workers, heartbeat_timeout=heartbeat_timeout, timeout=timeout,
                      script=(str(script), *argv[1:]), cwd=os.getcwd())
    except ValueError as e:
        raise LaunchError(str(e)) from None
    return launch_elastic_workers(lambda address: script_command(job), job, run_dir, port=port, threads=threads,
                                  out=out, on_started=on_started)


def script_command(job: JobSpec) -> list[str]:
    """The command a worker of a script job runs (the launcher's and `islands join`'s alike)."""
    return [sys.executable, *job.script]


def launch_elastic_workers(command: Callable[[str], list[str]], job: JobSpec, run_dir: Path, *, port: int = 0,
                           threads: int = 1, out=sys.stderr, on_started=None) -> int:
    """Run an elastic job of `job.workers` workers, each `command(address)` with ISLANDS_ELASTIC=address,
    ISLANDS_TOKEN and ISLANDS_NAME in its environment; `job` is what every worker (joiners included) reads
    from the store. `on_started(address, workers, coordinator)` lets experiments inject faults."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    if port and not port_is_free(port, "0.0.0.0"):
        raise LaunchError(f"port {port} is busy; choose another or use port=0 to pick a free one")
    token = job_token(run_dir, out)
    server, store = host_store(port)
    address = f"127.0.0.1:{server.port}"
    coordinator = Coordinator(store, token, job, log=lambda line: print(line, file=out, flush=True)).start()
    print(f"islands: elastic job at {address}; join with `islands join {address} --token-file PATH`", file=out,
          flush=True)
    started: list[WorkerProcess] = []
    try:
        for rank in range(job.workers):
            name = f"w{rank}"
            env = dict(os.environ, **{ELASTIC_ENV: address, TOKEN_ENV: token, NAME_ENV: name},
                       PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads))
            log = run_dir / "logs" / f"{name}.log"
            with open(log, "w") as f:
                proc = subprocess.Popen(command(address), env=env, stdout=f, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
            started.append(WorkerProcess(rank, proc, log))
        if on_started is not None:
            on_started(address, started, coordinator)
        return _supervise(started, store, coordinator, job.heartbeat_timeout, out)
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
