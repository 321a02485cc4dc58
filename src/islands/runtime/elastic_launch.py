"""The launcher of an elastic job: host the store, run the coordinator, start and watch the workers.

Policy (docs/membership.md): the launcher, not a worker, hosts the TCPStore, so any worker may die.
A worker that exits is reported dead in the store at once (so survivors need not wait for its
heartbeat to go stale) and the job carries on. A worker that is still running but whose heartbeat has
not moved for the heartbeat timeout (stopped with SIGSTOP, cut off, hung with the GIL held) is reported
dead the same way and killed after a grace; so is one the members excluded from their epoch (stuck in a
collective past its timeout) that does not exit by itself. So the launcher never waits on a process
the job has given up on. The job ends when none of its own workers is still running and no member of
the newest epoch is alive (joiners started elsewhere included, up to their heartbeat timeout). It
succeeds (exit 0) if at least one worker finished training; the launcher itself is the single point of
failure: if it dies, workers lose the store and exit with an error.
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
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from islands.runtime.launch import (GRACE_SECONDS, LaunchError, WorkerProcess, describe_exit, log_tail, port_is_free,
                                    signal_worker, stop_all)
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
                # its own session: Ctrl-C reaches the launcher only, which stops every worker and its children
                proc = subprocess.Popen(command(address), env=env, stdout=f, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            started.append(WorkerProcess(rank, proc, log, own_group=True))
        if on_started is not None:
            on_started(address, started, coordinator)
        return _supervise(started, coordinator.store, coordinator, job.heartbeat_timeout, out)
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
    reaper = _Reaper(store, heartbeat_timeout, out)
    while True:
        for w in workers:
            code = w.proc.poll()
            if code is None or w.rank in reported:
                continue
            reported.add(w.rank)
            if w.own_group:  # what it left behind (a data loader worker) goes with it
                signal_worker(w, signal.SIGKILL)
            coordinator.store.set(f"dead/w{w.rank}", "finished" if code == 0 else describe_exit(code))
            if code != 0:
                print(f"islands: worker w{w.rank} left ({describe_exit(code)}); the others carry on", file=out,
                      flush=True)
        reaper.look([w for w in workers if w.rank not in reported])
        if len(reported) == len(workers) and _no_member_alive(store, liveness):
            break
        time.sleep(0.05)
    finished = [w for w in workers if w.proc.returncode == 0]
    if finished:
        return 0
    first = workers[0]
    print(f"\nislands: every worker failed; last lines of {first.log}:\n{log_tail(first.log)}", file=out)
    return 1


class _Reaper:
    """Finds the launcher's own workers that run but are no longer part of the job, and kills them.

    Silent: its heartbeat has not moved for the heartbeat timeout (the heartbeat is a thread of its own, so
    a process merely busy still beats; a stopped, cut off or GIL-locked one does not). It is reported dead
    at once (members exclude it without waiting for their own check), sent SIGTERM, and SIGKILLed after
    KILL_GRACE (a stopped process acts on no other signal). Excluded: it was a member and the newest epoch
    no longer lists it (its heartbeat may still beat: a main thread stuck past the collective timeout); it
    gets the heartbeat timeout plus GRACE_SECONDS to notice and exit by itself (it raises Excluded at its
    next collective), then the same SIGTERM, SIGKILL. A worker that reported itself finished (its heartbeat
    stops there) is left to exit: a retired group can hold its exit up to its collective timeout."""

    KILL_GRACE = 2.0  # seconds between SIGTERM and SIGKILL for a silent worker

    def __init__(self, store, heartbeat_timeout: float, out):
        self.store, self.timeout, self.out = store, heartbeat_timeout, out
        self.liveness = Liveness(store, heartbeat_timeout)
        self.members_seen: set[str] = set()
        self.excluded_since: dict[str, float] = {}
        self.termed: dict[str, float] = {}  # name -> when SIGTERM went out

    def look(self, running: list[WorkerProcess]) -> None:
        now = time.monotonic()
        latest = int(self.store.get("latest")) if self.store.check(["latest"]) else 0
        members = {m[1] for m in get_json(self.store, f"e/{latest}/members", [])}
        self.members_seen |= members
        beating = [f"w{w.rank}" for w in running if self.store.check([f"hb/w{w.rank}"])]  # started: not loading
        silent = self.liveness.silent(beating)
        for w in running:
            name = f"w{w.rank}"
            if self.store.check([f"dead/{name}"]) and self.store.get(f"dead/{name}") == b"finished":
                continue  # it left the job itself (heartbeat stopped) and is exiting: bounded by its own timeout
            if name in self.termed:
                if now - self.termed[name] > self.KILL_GRACE and w.proc.poll() is None:
                    signal_worker(w, signal.SIGKILL)
                continue
            if name in silent:
                why = f"no heartbeat for {self.liveness.silent_for(name):.1f} s (stopped, cut off or hung)"
            elif name in self.members_seen and members and name not in members:
                since = self.excluded_since.setdefault(name, now)
                if now - since < self.timeout + GRACE_SECONDS:
                    continue
                why = f"excluded from epoch {latest} by the members and still running"
            else:
                self.excluded_since.pop(name, None)
                continue
            if not self.store.check([f"dead/{name}"]):
                self.store.set(f"dead/{name}", why)  # the members drop it now, not at their own timeout
            print(f"islands: worker {name}: {why}; stopping it (SIGKILL after {self.KILL_GRACE:.0f} s)",
                  file=self.out, flush=True)
            signal_worker(w, signal.SIGTERM)
            self.termed[name] = now


def _no_member_alive(store, liveness: Liveness) -> bool:
    latest = int(store.get("latest")) if store.check(["latest"]) else 0
    names = [m[1] for m in get_json(store, f"e/{latest}/members", [])]
    return len(liveness.gone(names)) == len(names)
