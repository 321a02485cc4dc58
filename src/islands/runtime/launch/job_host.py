"""The job host of an elastic job: a detached process that hosts the store and runs the coordinator.

    python -m islands.runtime.launch.job_host RUN_DIR --launcher-pid PID --job FILE [--port P | --store etcd://H:P,...]
                                       [--advertise ADDRESS]
    (the JobSpec as JSON in the file --job names, ISLANDS_TOKEN in the environment)

Why a process of its own (issue #20 item 2, docs/membership.md "No single point of failure"): the launcher
used to host the TCPStore and the coordinator thread, so a SIGKILLed launcher took the store with it and every
worker failed at its next store operation. The job host runs in its own session (start_new_session), like the
workers, so nothing that kills the launcher or its process group reaches it, and the workers keep their
store when the launcher dies. With `--store etcd://...` it hosts nothing: the job's keys go to a namespace
of their own in that etcd cluster (islands-<job id>), and its coordinator is one seat among the workers'
(membership.CoordinatorSeat: whoever holds the leadership lease coordinates), so it may die too.

It writes RUN_DIR/job_host.json ({"address", "pid", "job_id"}; temp file + os.replace, so a reader never
sees half of it) once the store listens and the job record is in it, and logs to its stdout (the launcher
points it at RUN_DIR/logs/job_host.log and relays the lines while it lives).

When it ends:
  * the launcher alive: when the launcher stops it (SIGTERM) after the job ended;
  * the launcher gone (its parent pid changed): by itself, once epoch 0 was formed and no member of the
    newest epoch has been alive (finished, reported dead, or heartbeat stale past the job's timeout) for
    LINGER_S, so the last members' final store writes land; or, if epoch 0 never forms, after the idle
    timeout (IDLE_S + the job's collective timeout).
On ending it rewrites job_host.json with {"ended", "why", "launcher_alive"}: the record of how the job
ended when no launcher was left to say it (the workers' own records, run.json written by the last epoch's
rank 0 included, do not depend on it).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import select
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from islands.runtime.elastic.auth import ControlAuth
from islands.runtime.elastic.etcd_store import EtcdAddress, EtcdStore
from islands.runtime.elastic.membership import (
    TOKEN_ENV,
    Coordinator,
    CoordinatorSeat,
    JobSpec,
    Liveness,
    authed,
    connect,
    host_store,
    no_member_alive,
)

RECORD = "job_host.json"  # in the run directory
JOB_FILE = "job_host.job.json"  # the JobSpec the launcher hands over (--job), in the run directory
LINGER_S = 2.0  # seconds the "no member alive" rule must hold before a host whose launcher died exits
IDLE_S = 60.0  # plus the job's collective timeout: a host whose launcher died and whose epoch 0 never formed
POLL_S = 0.2  # how often the host looks (Liveness needs looks closer than half the heartbeat timeout)


def write_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class HostLoop:
    """The host's own watch (its main thread; the coordinator answers joins on a thread of its own).
    `store`: an authenticated client of the job's store; `formed()`: whether epoch 0 exists."""

    def __init__(self, store, job: JobSpec, formed, launcher_pid: int, log=print):
        self.store, self.job, self.formed, self.launcher_pid, self.log = store, job, formed, launcher_pid, log
        self.liveness = Liveness(store, job.heartbeat_timeout)
        self.stop = threading.Event()
        self.started = time.monotonic()
        # The launcher is not always the parent (a copy of the fork server is the server's child), so its exit is
        # watched through a pidfd, which a recycled pid cannot fool; without pidfds, by the pid alone.
        self._launcher_fd: int | None = None
        try:
            self._launcher_fd = os.pidfd_open(launcher_pid)
        except (AttributeError, OSError):  # gone already (ProcessLookupError), or no pidfd on this system
            pass
        self._launcher_gone = self._launcher_fd is None and not _pid_exists(launcher_pid)

    def launcher_alive(self) -> bool:
        if self._launcher_gone:
            return False
        if self._launcher_fd is not None:  # readable once the process has exited
            self._launcher_gone = bool(select.select([self._launcher_fd], [], [], 0)[0])
        else:
            self._launcher_gone = not _pid_exists(self.launcher_pid)
        return not self._launcher_gone

    def run(self) -> tuple[str, bool]:
        """Until the job ended; returns (why, whether the launcher was still alive)."""
        idle = IDLE_S + self.job.timeout
        quiet_since = None
        said_orphan = False
        while not self.stop.wait(POLL_S):
            if self.launcher_alive():
                quiet_since = None
                continue
            if not said_orphan:
                said_orphan = True
                self.log(
                    f"job host: the launcher (pid {self.launcher_pid}) is gone; the job goes on, and this "
                    "host ends once no member of the newest epoch is alive"
                )
            if not self.formed():
                if time.monotonic() - self.started > idle:
                    return f"the launcher died and epoch 0 did not form within {idle:.0f} s", False
                continue
            try:
                ended = no_member_alive(self.store, self.liveness)
            except Exception as e:  # noqa: BLE001 - a value overwritten from outside: look again
                self.log(f"job host: {e}")
                continue
            if not ended:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > LINGER_S:
                return "no member of the newest epoch is alive", False
        return "stopped by the launcher", self.launcher_alive()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m islands.runtime.launch.job_host")
    p.add_argument("run_dir")
    p.add_argument("--launcher-pid", type=int, required=True)
    p.add_argument("--port", type=int, default=0, help="the embedded store's port (0: a free one)")
    p.add_argument("--store", default="", help="etcd://HOST:PORT,... : keep the job in this etcd cluster instead")
    p.add_argument(
        "--advertise",
        default="127.0.0.1",
        help="the address workers reach the embedded store at (a testbed's hub address)",
    )
    p.add_argument("--job", required=True, help="the file holding the JobSpec as JSON (the launcher writes it)")
    args = p.parse_args(argv)
    token = os.environ.pop(TOKEN_ENV, "")  # not inherited by anything this process might start
    job = JobSpec.from_json(Path(args.job).read_text())
    job = job if job.job_id else replace(job, job_id=secrets.token_hex(16))
    run_dir = Path(args.run_dir)

    def log(line: str) -> None:
        print(line, flush=True)

    server = seat = coordinator = None
    etcd: EtcdStore | None = None  # the replicated store's unauthenticated client (end() marks the job ended)
    if args.store:  # replicated: the job's keys under a namespace of its own; the coordinator is whoever leads
        address = str(EtcdAddress.parse(args.store).with_namespace(f"islands-{job.job_id[:12]}"))
        opened = connect(address, 0)
        assert isinstance(opened, EtcdStore)  # connect opens an etcd address as an EtcdStore
        etcd = opened
        etcd.set("job", job.seal(token))
        seat = CoordinatorSeat(address, token, job, "job-host", log=log)
        store = authed(etcd, ControlAuth(token, job.job_id, "job-host"), log)
        formed = lambda: store.check(["e/0/members"])  # noqa: E731
        coordinating: CoordinatorSeat | Coordinator = seat
    else:
        server, raw = host_store(args.port)
        coordinator = Coordinator(raw, token, job, log=log)
        address, store = f"{args.advertise}:{server.port}", coordinator.store
        formed = lambda: coordinator.formed  # noqa: E731
        coordinating = coordinator
    loop = HostLoop(store, job, formed, args.launcher_pid, log=log)
    signal.signal(signal.SIGTERM, lambda *_: loop.stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle (it stops this host)
    coordinating.start()
    record = {
        "address": address,
        "pid": os.getpid(),
        "job_id": job.job_id,
        "launcher_pid": args.launcher_pid,
        "started": time.time(),
    }
    write_atomic(run_dir / RECORD, record)
    log(f"job host: store and coordinator at {address} (pid {os.getpid()})")
    why, launcher_alive = loop.run()
    coordinating.stop()
    end = dict(record, ended=time.time(), why=why, launcher_alive=launcher_alive)
    if coordinator is not None:
        end.update(admitted=len(coordinator.admitted), refused=coordinator.refused)
    if seat is not None and etcd is not None:
        end.update(coordinator_terms=seat.terms)
        try:
            etcd.end()  # clients (a joiner still waiting) now see the job's store as gone
        except Exception as e:  # noqa: BLE001 - no etcd majority: the joiner's wait is then bounded by its own
            log(f"job host: could not mark the job ended in etcd: {e}")
    write_atomic(run_dir / RECORD, end)
    log(f"job host: ending ({why})")
    del server
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # nothing to finalise: the store's clients are gone or going
