"""The launcher of an elastic job: start the job host, start and watch the workers.

Policy (docs/membership.md): the store and the coordinator live in the job host (islands.runtime.launch.job_host), a
detached process in a session of its own, not in the launcher nor in a worker: any worker may die, and so
may the launcher (issue #20 item 2). A worker that exits is reported dead in the store at once (so
survivors need not wait for its heartbeat to go stale) and the job carries on. A worker that is still
running but whose heartbeat has not moved for the heartbeat timeout (stopped with SIGSTOP, cut off, hung
with the GIL held) is reported dead the same way and killed after a grace; so is one the members excluded
from their epoch (stuck in a collective past its timeout) that does not exit by itself. So the launcher
never waits on a process the job has given up on. The job ends when none of its own workers is still
running and no member of the newest epoch is alive (joiners started elsewhere included, up to their
heartbeat timeout). It succeeds (exit 0) if at least one worker finished training. If the launcher dies
(SIGKILL), its workers run on in their own sessions with the job host's store, deaths are then seen by
heartbeat only, rank 0 of the last epoch still writes run.json, and the job host ends by itself once no
member is alive. The job host is then what the job cannot lose: with `--store etcd://...` the store is
an etcd cluster instead (islands.runtime.elastic.etcd_store) and no single process is needed.
The token comes from ISLANDS_TOKEN or is generated and written to RUN_DIR/token (mode 0600); it is
never printed.

Every worker gets ISLANDS_ELASTIC=HOST:PORT (the store), ISLANDS_TOKEN and ISLANDS_NAME (w0, w1, ...). What
it runs is the caller's: islands' own elastic worker (`islands train --elastic`, islands.app.launch) or any
script that calls islands.init_world() (`islands run --elastic`, launch_elastic_script). The store's "job"
key (membership.JobSpec) tells a joiner what to run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from islands.runtime import stacks
from islands.runtime.elastic import starvation
from islands.runtime.elastic.auth import ControlAuth
from islands.runtime.elastic.etcd_store import EtcdAddress, EtcdStore
from islands.runtime.elastic.island_comm import ISLAND_ENV, IslandPlace, worker_name
from islands.runtime.elastic.membership import (
    ELASTIC_ENV,
    JOB_ENDED_EXIT_CODE,
    LAUNCHER,
    NAME_ENV,
    REFUSED_EXIT_CODE,
    TOKEN_ENV,
    JobSpec,
    Liveness,
    authed,
    connect,
    get_json,
    no_member_alive,
    parse_address,
)
from islands.runtime.launch import job_host, spawn
from islands.runtime.launch.ranks import (
    GRACE_SECONDS,
    LaunchError,
    WorkerProcess,
    describe_exit,
    exit_of,
    job_token,
    log_tail,
    port_is_free,
    signal_worker,
    stop_all,
)
from islands.testbed import Testbed


def launch_elastic_script(
    argv: list[str],
    workers: int,
    run_dir: Path,
    *,
    heartbeat_timeout: float = 3.0,
    timeout: float = 120.0,
    port: int = 0,
    threads: int = 1,
    out=None,
    on_started=None,
    store: EtcdAddress | None = None,
    testbed: Testbed | None = None,
    islands: int | None = None,
    max_restarts: int = 0,
) -> int:
    """`islands run --elastic`: run `argv` (a script and its arguments) as an elastic job of `workers` workers.

    The script joins with islands.init_world() and needs an outer strategy (joins happen at its round
    boundaries). Its path is made absolute and stored with its arguments and this directory, so that `islands
    join` starts the same program anywhere. `islands`: the workers form that many islands of workers/islands
    each (default: one worker per island), which join and leave as a whole; `max_restarts`: times a failed
    island is started again. Returns the exit code (as launch_elastic_workers)."""
    out = sys.stderr if out is None else out
    if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
        raise LaunchError(f"argv must be a non-empty list of strings (the script and its arguments); got {argv!r}")
    script = Path(argv[0]).resolve()
    if not script.is_file():
        raise LaunchError(f"script {argv[0]!r} is not a file")
    islands = workers if islands is None else islands
    if isinstance(islands, bool) or not isinstance(islands, int) or islands < 1 or workers % islands:
        raise LaunchError(f"islands must divide the {workers} workers into islands of equal size; got {islands!r}")
    try:
        job = JobSpec(
            workers=islands,
            heartbeat_timeout=heartbeat_timeout,
            timeout=timeout,
            script=(str(script), *argv[1:]),
            cwd=os.getcwd(),
            island_size=workers // islands,
        )
    except ValueError as e:
        raise LaunchError(str(e)) from None
    return launch_elastic_workers(
        lambda address: script_command(job),
        job,
        run_dir,
        port=port,
        threads=threads,
        out=out,
        on_started=on_started,
        store=store,
        testbed=testbed,
        max_restarts=max_restarts,
    )


def script_command(job: JobSpec) -> list[str]:
    """The command a worker of a script job runs (the launcher's and `islands join`'s alike)."""
    return [sys.executable, *job.script]


def launch_elastic_workers(
    command: Callable[[str], list[str]],
    job: JobSpec,
    run_dir: Path,
    *,
    port: int = 0,
    threads: int = 1,
    out=None,
    on_started=None,
    max_restarts: int = 0,
    store: EtcdAddress | None = None,
    testbed: Testbed | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Run an elastic job of `job.workers` workers, each `command(address)` with ISLANDS_ELASTIC=address,
    ISLANDS_TOKEN and ISLANDS_NAME in its environment; `job` is what every worker (joiners included) reads
    from the store. `on_started(address, workers, coordinator)` lets experiments inject faults (`coordinator`:
    the JobHost handle; `.store` is the launcher's authenticated client). `store`: an etcd cluster to keep the
    job in (islands.runtime.elastic.etcd_store) instead of the job host's embedded store. Each island has
    `job.island_size` workers (job.workers counts islands, whose leaders are the members;
    islands.runtime.elastic.island_comm);
    `max_restarts`: times a failed island is started again (_supervise). `testbed`: run island i inside host
    i % hosts of this network testbed (all its workers on that host, gloo bound to its link) and the job host on
    the testbed's hub, which every host reaches over its own shaped link; an etcd `store` must then serve on
    an address the hosts reach (the hub's, islands.testbed.EtcdCluster(netns=...)). `env`: variables every worker
    gets on top of the launcher's."""
    out = sys.stderr if out is None else out
    if store is not None and not isinstance(store, EtcdAddress):
        raise LaunchError(f"store must be an EtcdAddress (parsed from etcd://HOST:PORT,...); got {store!r}")
    if testbed is not None:
        try:
            testbed.require_hub_ip()  # a testbed built before hubs had an address: say to rebuild it
        except LookupError as e:
            raise LaunchError(str(e)) from None
    if port and testbed is not None:
        raise LaunchError(f"the port is chosen inside the testbed; leave port 0 with a testbed (got {port})")
    if port and store is None and not port_is_free(port, "0.0.0.0"):
        raise LaunchError(f"port {port} is busy; choose another or use port=0 to pick a free one")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    token = job_token(run_dir, out, "elastic job")
    host = JobHost.start(job, run_dir, token, port, out, store, testbed)
    address, coordinator = host.address, host
    print(
        f"islands: elastic job at {address}; join with `islands join {address} --token-file PATH`", file=out, flush=True
    )
    started: list[WorkerProcess] = []
    try:
        # job.workers islands of island_size workers each (one-worker islands: w0, w1, ... as before)
        islands = _Islands(command, address, token, run_dir, threads, job.island_size, max_restarts, testbed, env)
        for index in range(job.workers):
            started += islands.start(index)
        if on_started is not None:
            on_started(address, started, coordinator)
        rule = join_rule(job)
        return _supervise(started, coordinator.store, coordinator, job.heartbeat_timeout, out, islands, rule)
    except KeyboardInterrupt:
        print("interrupted: stopping all workers", file=out)
        return 130
    finally:
        stop_all(started)
        host.stop()
        spawn.release_stopped_server(out)


class JobHost:
    """The launcher's handle on the job host (islands.runtime.launch.job_host): a detached process, in a session of
    its own, that hosts the store and runs the coordinator, so the launcher's death leaves the workers their
    store. `store` is the launcher's authenticated client (it reports its workers' exits there); the host's
    log lines (admissions, refusals) are relayed to `out` while the launcher lives."""

    START_TIMEOUT_S = 120.0  # importing torch on a loaded machine is most of it

    def __init__(
        self,
        proc: subprocess.Popen | spawn.ForkedProcess,
        address: str,
        store,
        log: Path,
        out,
        raw=None,
        record: Path | None = None,
    ):
        self.proc, self.address, self.store, self.log_path, self.out = proc, address, store, log, out
        self.raw, self.record = raw, record  # the unauthenticated client (EtcdStore.end) and job_host.json
        self._stopped_since: float | None = None  # since when the host process is stopped (trouble)
        self._stop = threading.Event()
        self._relay = threading.Thread(target=self._follow, name="islands-job-host-log", daemon=True)
        self._relay.start()

    @classmethod
    def start(
        cls,
        job: JobSpec,
        run_dir: Path,
        token: str,
        port: int,
        out,
        store: EtcdAddress | None = None,
        testbed: Testbed | None = None,
    ) -> JobHost:
        record = run_dir / job_host.RECORD
        record.unlink(missing_ok=True)
        log = run_dir / "logs" / "job_host.log"
        env = dict(os.environ, **{TOKEN_ENV: token}, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        job_file = run_dir / job_host.JOB_FILE
        job_host.write_atomic(job_file, json.loads(job.to_json()))  # the job's shape, no secret (the token is in env)
        argv = [
            sys.executable,
            "-m",
            "islands.runtime.launch.job_host",
            str(run_dir),
            "--launcher-pid",
            str(os.getpid()),
            "--port",
            str(port),
            "--job",
            str(job_file),
            *(["--store", str(store)] if store is not None else []),
        ]
        netns = testbed.hub if testbed is not None else None
        proc: subprocess.Popen | spawn.ForkedProcess
        with open(log, "w") as f:
            if testbed is not None:  # `ip netns exec` execs: the host's parent is still this launcher
                argv = testbed.wrap_hub(argv + ["--advertise", testbed.hub_ip])
                proc = subprocess.Popen(
                    argv, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
                )
            else:  # a copy of the preloaded fork server (spawn): it skips importing torch, ~2-3 s of CPU a job
                proc = spawn.start(argv, env, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + cls.START_TIMEOUT_S
        while True:
            info = get_json_file(record)
            if info is not None and info.get("pid") == proc.pid:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                if proc.poll() is None:
                    proc.kill()
                raise LaunchError(
                    f"the elastic job host did not start (exit {proc.poll()}); its log {log}:\n{log_tail(log)}"
                )
            time.sleep(0.05)
        address = info["address"]
        host, p = parse_address(address)
        raw = connect(host, p, netns=netns)  # on a testbed, from inside its hub (islands.runtime.netns)
        authed_store = authed(
            raw,
            ControlAuth(token, JobSpec.read(raw, token).job_id, LAUNCHER),
            lambda line: print(line, file=out, flush=True),
        )
        return cls(proc, address, authed_store, log, out, raw=raw, record=record)

    def trouble(self, patience: float) -> str | None:
        """Why the job cannot go on with its store, or None: the job host exited, or has been stopped (SIGSTOP) for
        `patience` seconds. An etcd job's keys do not live in the host (its death loses nothing): never then."""
        if isinstance(self.raw, EtcdStore):
            return None
        code = self.proc.poll()
        if code is not None:
            return f"the job host (pid {self.proc.pid}, the job's store) ended ({describe_exit(code)})"
        now = time.monotonic()
        if spawn.process_state(self.proc.pid) not in ("T", "t"):
            self._stopped_since = None
            return None
        self._stopped_since = self._stopped_since or now
        if now - self._stopped_since < patience:
            return None
        return (
            f"the job host (pid {self.proc.pid}, the job's store) has been stopped for "
            f"{now - self._stopped_since:.1f} s"
        )

    def mark_dead(self, name: str) -> None:
        self.store.set(f"dead/{name}", "1")

    def latest_epoch(self) -> int:
        return int(self.store.get("latest")) if self.store.check(["latest"]) else 0

    def _follow(self) -> None:
        with open(self.log_path, errors="replace") as f:
            while True:
                line = f.readline()
                if line:
                    if not line.startswith("job host: "):  # its own start and end lines stay in its log
                        print(line.rstrip("\n"), file=self.out, flush=True)
                    continue
                if self._stop.wait(0.05):
                    return

    def stop(self) -> None:
        """SIGTERM (it ends its coordinator and writes its record), SIGKILL after GRACE_SECONDS."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        time.sleep(0.1)  # the relay's last lines
        self._stop.set()
        self._relay.join(timeout=1)
        self._end_orphaned_store()

    def _end_orphaned_store(self) -> None:
        """An etcd job whose job host died (SIGKILL, a lost machine) was not marked ended: its keys would stay in
        the cluster and a joiner still waiting elsewhere would wait out its own rule. The launcher, which
        outlived it, ends the namespace instead (EtcdStore.end: the mark, every other key deleted). A host
        that ended the job itself says so in its record ("ended")."""
        if not isinstance(self.raw, EtcdStore) or self.record is None:
            return
        if "ended" in (get_json_file(self.record) or {}):
            return
        try:
            if not self.raw.ended():
                self.raw.end()
                print(
                    "islands: the job host had died; the launcher marked the job ended in etcd and removed its keys",
                    file=self.out,
                    flush=True,
                )
        except Exception as e:  # noqa: BLE001 - no etcd majority: the keys stay (docs/membership.md)
            print(
                f"islands: could not mark the job ended in etcd ({e}); its keys stay under "
                f"{self.address.rsplit('/', 1)[-1]}/",
                file=self.out,
                flush=True,
            )


def get_json_file(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class _HostLost(Exception):
    """The job host, whose store the job runs on, is gone or stopped (JobHost.trouble says how)."""


def _supervise(
    workers: list[WorkerProcess],
    store,
    coordinator: JobHost,
    heartbeat_timeout: float,
    out,
    islands: _Islands | None = None,
    rule: JoinRule | None = None,
) -> int:
    """_watch, ended with a clear error when the job host is lost (exited, or stopped for the heartbeat timeout):
    the workers cannot go on without their store, so they are stopped, unless every one of them had finished
    (exit 0) already, which is a finished job. A watchdog thread looks at the host; a stopped host is SIGKILLed
    once it counts as lost, so that no store operation of the launcher stays blocked on it (a TCPStore client
    waits for a stopped server's answer for ever)."""
    watchdog = _HostWatchdog(coordinator, heartbeat_timeout)
    try:
        return _watch(workers, store, watchdog, heartbeat_timeout, out, islands, rule)
    except _HostLost as e:
        if workers and all(w.proc.poll() == 0 for w in workers):
            print(f"islands: {e} after every worker had finished", file=out, flush=True)
            return 0
        print(f"\nislands: {e}; the job cannot go on without its store: stopping the workers", file=out, flush=True)
        return 1
    finally:
        watchdog.stop.set()


class _HostWatchdog(threading.Thread):
    """Looks at the job host every 0.2 s (JobHost.trouble); once it is lost, says why (`why`) and SIGKILLs it if it
    still exists (stopped), which fails the launcher's store operation that waits on it. `coordinator` is passed
    on to _watch (its `.store`)."""

    def __init__(self, coordinator: JobHost, patience: float):
        super().__init__(name="islands-job-host-watchdog", daemon=True)
        self.coordinator, self.store, self.patience = coordinator, coordinator.store, patience
        self.why: str | None = None
        self.stop = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            why = self.coordinator.trouble(self.patience)
            if why:
                self.why = why
                if self.coordinator.proc.poll() is None:
                    self.coordinator.proc.kill()
                return

    def check(self, wait: float = 0.0) -> None:
        """Raise _HostLost when the host is lost; `wait`: seconds to give the watchdog to tell (a store operation
        just failed: the host's fault, or not)."""
        deadline = time.monotonic() + wait
        while self.why is None and self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.why:
            raise _HostLost(self.why)


def _watch(
    workers: list[WorkerProcess],
    store,
    coordinator: _HostWatchdog,
    heartbeat_timeout: float,
    out,
    islands: _Islands | None = None,
    rule: JoinRule | None = None,
) -> int:
    """Watch the workers until the job ended. Islands are the unit (docs/membership.md, "Islands of k workers"):
    a worker of island i that exits non-zero takes its island out (its mates are stopped and reported dead,
    so the members fail over without its leader at once), and island i starts again as a new incarnation
    while islands.max_restarts allows and `rule` (who lets it back in: by default the members, MembersAdmit)
    does: then a restarted island that the job ends before admitting is stopped. `workers` grows with the
    restarts (the caller stops them all)."""
    rule = MembersAdmit() if rule is None else rule
    reported: set[str] = set()
    liveness = Liveness(store, heartbeat_timeout)
    reaper = _Reaper(store, heartbeat_timeout, out, islands)
    stopped: set[str] = set()  # mates the launcher stopped because their island left
    closing = False  # the job ended: no restarts, waiting restarted islands are stopped
    next_look = 0.0
    try:
        while True:
            coordinator.check()
            for w in list(workers):
                code = w.proc.poll()
                name = _name(w)
                if code is None or name in reported:
                    continue
                reported.add(name)
                if w.own_group:  # what it left behind (a data loader worker) goes with it
                    signal_worker(w, signal.SIGKILL)
                if name in stopped:
                    continue  # reported dead when it was stopped
                why = exit_of(w.proc)
                coordinator.store.set(f"dead/{name}", "finished" if code == 0 else why)
                if code == 0:
                    continue
                print(f"islands: worker {name} left ({why}); the others carry on", file=out, flush=True)
                if islands is not None and islands.whole:
                    assert isinstance(w, IslandWorker)  # _Islands.start starts every worker of a launch
                    mates = [m for m in workers if islands.same(m, w) and _name(m) not in reported | stopped]
                    for m in mates:
                        stopped.add(_name(m))
                        coordinator.store.set(f"dead/{_name(m)}", f"its island lost {name}")
                        signal_worker(m, signal.SIGKILL)
                    if islands.size > 1:
                        print(
                            f"islands: island {w.island} left the job ({name}: {why})"
                            + (f"; stopped {', '.join(_name(m) for m in mates)}" if mates else ""),
                            file=out,
                            flush=True,
                        )
                    gone = {_name(m) for m in workers if islands.same(m, w)}
                    if closing or code in (REFUSED_EXIT_CODE, JOB_ENDED_EXIT_CODE):
                        pass
                    elif islands.restarts.get(w.island, 0) >= islands.max_restarts:
                        if islands.max_restarts:
                            print(
                                f"islands: island {w.island} is not restarted: its {islands.max_restarts} restart(s) "
                                "(--max-restarts) are used up",
                                file=out,
                                flush=True,
                            )
                    elif refusal := rule.restart_refusal(store, liveness, gone):
                        print(f"islands: island {w.island} is not restarted: {refusal}", file=out, flush=True)
                    else:
                        fresh = islands.restart(w.island, why=f"{name}: {why}")
                        workers += fresh
                        print(
                            f"islands: restarting island {w.island} (restart {islands.restarts[w.island]} of "
                            f"{islands.max_restarts}) as {', '.join(_name(f) for f in fresh)}; it rejoins as the outer "
                            "strategy admits joiners (at a round boundary; a parameter server's at once)",
                            file=out,
                            flush=True,
                        )
            running = [w for w in workers if _name(w) not in reported]
            if time.monotonic() < next_look:  # exits are polled every 50 ms; the store (etcd: HTTP) every LOOK_S
                time.sleep(0.05)
                continue
            next_look = time.monotonic() + LOOK_S
            reaper.look([w for w in running if _name(w) not in stopped])
            ended = rule.ended(store, liveness, finished=any(w.proc.returncode == 0 for w in workers))
            if ended and islands is not None:
                closing = True
                waiting = [
                    w
                    for w in running
                    if rule.members_admit
                    and isinstance(w, IslandWorker)
                    and w.incarnation > 0
                    and _name(w) not in stopped
                    and islands.leader_name(w) not in reaper.members_seen
                ]
                for w in waiting:  # admitted by nobody, ever: the members are gone
                    stopped.add(_name(w))
                    print(
                        f"islands: worker {_name(w)}: the job ended before its island was admitted; stopping it",
                        file=out,
                        flush=True,
                    )
                    coordinator.store.set(f"dead/{_name(w)}", "the job ended before its island was admitted")
                    signal_worker(w, signal.SIGKILL)
            if len(reported) == len(workers) and (not store.check(["e/0/members"]) or no_member_alive(store, liveness)):
                break
            time.sleep(0.05)
    except RuntimeError:  # a store operation failed: the host's fault (a clear error), or not (raised as it was)
        coordinator.check(wait=1.0)
        raise
    finished = [w for w in workers if w.proc.returncode == 0]
    if finished:
        return 0
    first = workers[0]
    print(f"\nislands: every worker failed; last lines of {first.log}:\n{log_tail(first.log)}", file=out)
    return 1


@dataclass
class IslandWorker(WorkerProcess):
    """A worker the elastic launcher started: its name in the job, its island and the island's incarnation."""

    name: str = ""
    island: int = 0
    incarnation: int = 0


def _name(w: WorkerProcess) -> str:
    return getattr(w, "name", "") or f"w{w.rank}"


class _Islands:
    """Starts the job's islands: `size` workers each, named by islands.runtime.elastic.island_comm.worker_name, with
    ISLANDS_ISLAND (their place) when an island has several workers or may be restarted. Keeps the restart
    count per island and writes every restart to RUN_DIR/elastic/restarts.json."""

    def __init__(
        self,
        command,
        address: str,
        token: str,
        run_dir: Path,
        threads: int,
        size: int,
        max_restarts: int,
        testbed: Testbed | None = None,
        env: dict[str, str] | None = None,
    ):
        if size < 1 or max_restarts < 0:
            raise LaunchError(f"island_size must be >= 1 and max_restarts >= 0; got {size} and {max_restarts}")
        self.command, self.address, self.token, self.run_dir = command, address, token, run_dir
        self.threads, self.size, self.max_restarts = threads, size, max_restarts
        self.testbed, self.env = testbed, dict(env or {})
        self.restarts: dict[int, int] = {}
        self.log: list[dict] = []

    @property
    def whole(self) -> bool:
        """Islands leave and come back as a whole (several workers, or restarts allowed)."""
        return self.size > 1 or self.max_restarts > 0

    def same(self, a: WorkerProcess, b: WorkerProcess) -> bool:
        return (getattr(a, "island", None), getattr(a, "incarnation", None)) == (
            getattr(b, "island", None),
            getattr(b, "incarnation", 0),
        )

    def leader_name(self, w: IslandWorker) -> str:
        return worker_name(w.island, 0, self.size, w.incarnation)

    def start(self, index: int, incarnation: int = 0) -> list[IslandWorker]:
        out = []
        for local in range(self.size):
            name = worker_name(index, local, self.size, incarnation)
            env = dict(
                os.environ,
                **self.env,
                **{ELASTIC_ENV: self.address, TOKEN_ENV: self.token, NAME_ENV: name},
                PYTHONUNBUFFERED="1",
                OMP_NUM_THREADS=str(self.threads),
            )
            env.pop(ISLAND_ENV, None)
            if self.whole:
                env[ISLAND_ENV] = IslandPlace(index, local, self.size, incarnation).to_env()
            netns = None
            if self.testbed is not None:  # the island on its host: its workers talk over loopback, others over the link
                host = self.testbed.host(index % len(self.testbed.hosts))
                env.update(self.testbed.env(host.index))
                netns = host.netns
            log = self.run_dir / "logs" / f"{name}.log"
            with open(log, "w") as f:
                # its own session: Ctrl-C reaches the launcher only, which stops every worker and its children
                proc = spawn.start(self.command(self.address), env, stdout=f, stderr=subprocess.STDOUT, netns=netns)
            out.append(
                IslandWorker(
                    index * self.size + local,
                    proc,
                    log,
                    own_group=True,
                    name=name,
                    island=index,
                    incarnation=incarnation,
                )
            )
        return out

    def restart(self, index: int, why: str) -> list[IslandWorker]:
        n = self.restarts[index] = self.restarts.get(index, 0) + 1
        fresh = self.start(index, n)
        self.log.append(
            {"island": index, "incarnation": n, "time": time.time(), "why": why, "workers": [w.name for w in fresh]}
        )
        path = self.run_dir / "elastic" / "restarts.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"max_restarts": self.max_restarts, "restarts": self.log}, indent=1))
        os.replace(tmp, path)  # never half-written
        return fresh


class JoinRule(Protocol):
    """Who lets a restarted island back into the job, as the launcher's restarts and its end see it: the members
    (MembersAdmit) or a service of the job's own (ServiceAdmits). join_rule picks it from the job's record."""

    members_admit: bool  # a restarted island waits for a member to put it in an epoch

    def restart_refusal(self, store, liveness: Liveness, gone: set[str]) -> str | None:
        """Why an island whose workers `gone` just left is not restarted now (restarts left aside), or None."""
        ...

    def ended(self, store, liveness: Liveness, finished: bool) -> bool:
        """Whether the job's end has come (no more restarts); `finished`: some worker finished (exit 0)."""
        ...


class MembersAdmit:
    """The synchronous outer strategies': a restarted island enters at a round boundary of the members, who send
    it the global state. Nobody can admit it without a live member, so none is restarted then, and once no
    member of the newest epoch is alive the job has ended."""

    members_admit = True

    def restart_refusal(self, store, liveness: Liveness, gone: set[str]) -> str | None:
        latest = int(store.get("latest")) if store.check(["latest"]) else 0
        others = [m[1] for m in get_json(store, f"e/{latest}/members", []) if m[1] not in gone]
        return None if len(liveness.gone(others)) < len(others) else "no other island is alive to admit it"

    def ended(self, store, liveness: Liveness, finished: bool) -> bool:
        return no_member_alive(store, liveness)


class ServiceAdmits:
    """A served job's (JobSpec.served: the parameter server's processes hold the global model): a restarted island
    pulls the model from the service and trains at once, needing no live member, so it is restarted while its
    restarts last whoever else is alive. The job's end is the service's final answer: an island that finished
    (exit 0) had it, and every island still training had asked for it, so a later restart would find the
    service stopping and train nothing."""

    members_admit = False

    def restart_refusal(self, store, liveness: Liveness, gone: set[str]) -> str | None:
        return None

    def ended(self, store, liveness: Liveness, finished: bool) -> bool:
        return finished


def join_rule(job: JobSpec) -> JoinRule:
    """The launcher's rule for the job: the record says whether joiners need the members (JobSpec.served)."""
    return ServiceAdmits() if job.served else MembersAdmit()


# Seconds between the supervisor's looks at the store (heartbeats, epochs). Each look reads a few keys per
# worker; at 50 ms a 6-worker job sent etcd's gateway ~600 requests a second, enough CPU on a 2-core machine
# to delay the workers' own beats past a 1.5 s heartbeat timeout (false deaths in the chaos experiment).
LOOK_S = 0.1


class _Reaper:
    """Finds the launcher's own workers that run but are no longer part of the job, and kills them.

    Silent: its heartbeat has not moved for the heartbeat timeout (the heartbeat is a thread of its own, so
    a process merely busy still beats; a stopped, cut off or GIL-locked one does not). It is reported dead
    and SIGKILLed at once: members exclude it without waiting for their own check, and a stopped or
    GIL-locked process would act on no gentler signal, so a grace would only hold its island's mates in
    their local collective for longer (issue #20's 2 s stall goal). With `islands` whole, its island mates are
    reported dead in the same look: the members stop waiting for a leader whose follower is frozen at once, not
    when the killed follower's exit has been polled. Excluded: it was a member and the newest epoch
    no longer lists it (its heartbeat may still beat: a main thread stuck past the collective timeout); it
    gets the heartbeat timeout plus GRACE_SECONDS to notice and exit by itself (it raises Excluded at its
    next collective), then the same SIGTERM, SIGKILL. A worker that reported itself finished (its heartbeat
    stops there) is left to exit: a retired group can hold its exit up to its collective timeout.

    Before a silent worker's SIGKILL the reaper reads its process state and asks it for its threads' stacks
    (islands.runtime.stacks): a false death (a live process that could not beat) leaves its cause in the log. A
    silent process that is runnable but got almost no CPU during its silence waits for one; it is spared up to
    STARVED_LIMIT heartbeat timeouts (islands.runtime.elastic.starvation)."""

    KILL_GRACE = 2.0  # seconds between SIGTERM and SIGKILL for an excluded worker that still runs
    # A silent process that is runnable (state R) but used less CPU than starvation.SHARE of its silence was
    # waiting for a CPU, not hung: a loaded machine or a VM's stolen vCPU (CI's false deaths; its dump signal
    # went unanswered for 0.3 s). It gets up to starvation.LIMIT heartbeat timeouts before it counts as silent.
    STARVED_LIMIT = starvation.LIMIT

    def __init__(self, store, heartbeat_timeout: float, out, islands: _Islands | None = None):
        self.store, self.timeout, self.out, self.islands = store, heartbeat_timeout, out, islands
        self.liveness = Liveness(store, heartbeat_timeout)
        self.members_seen: set[str] = set()
        self.excluded_since: dict[str, float] = {}
        self.termed: dict[str, float] = {}  # name -> when SIGTERM went out
        self.starvation = starvation.Starvation(heartbeat_timeout)  # CPU samples of the beating workers, per look

    def _waits_for_cpu(self, w: WorkerProcess, now: float) -> bool:
        """Whether silent `w` is runnable but starved of CPU since its silence began, and still within
        STARVED_LIMIT heartbeat timeouts: then it is spared this look (said once)."""
        name = _name(w)
        silent_for = self.liveness.silent_for(name)
        starved = self.starvation.waits_for_cpu(name, w.proc.pid, silent_for, now)
        if starved is None:
            return False
        if starved[2]:
            print(
                f"islands: worker {name}: no heartbeat for {silent_for:.1f} s, but its process is waiting for a CPU "
                f"(it used {starved[0]:.2f} s of CPU in {starved[1]:.1f} s); not killing it before "
                f"{self.STARVED_LIMIT * self.timeout:.1f} s of silence",
                file=self.out,
                flush=True,
            )
        return True

    def look(self, running: list[WorkerProcess]) -> None:
        now = time.monotonic()
        latest = int(self.store.get("latest")) if self.store.check(["latest"]) else 0
        members = {m[1] for m in get_json(self.store, f"e/{latest}/members", [])}
        self.members_seen |= members
        beating = [_name(w) for w in running if self.store.check([f"hb/{_name(w)}"])]  # started: not loading
        silent = self.liveness.silent(beating)
        for w in running:
            if _name(w) in beating:
                self.starvation.sample(_name(w), w.proc.pid, now)
        for w in running:
            name = _name(w)
            if self.store.check([f"dead/{name}"]) and self.store.get(f"dead/{name}") == b"finished":
                continue  # it left the job itself (heartbeat stopped) and is exiting: bounded by its own timeout
            if name in self.termed:
                if now - self.termed[name] > self.KILL_GRACE and w.proc.poll() is None:
                    signal_worker(w, signal.SIGKILL)
                continue
            if name in silent and self._waits_for_cpu(w, now):
                continue
            if name in silent:  # a stopped or GIL-locked process acts on no gentler signal: SIGKILL at once
                state = stacks.state(w.proc.pid)
                why = f"no heartbeat for {self.liveness.silent_for(name):.1f} s (stopped, cut off or hung" + (
                    f"; its process is {state})" if state else ")"
                )
                sig, doing = signal.SIGKILL, "killing it"
            elif name in self.members_seen and members and name not in members:
                since = self.excluded_since.setdefault(name, now)
                if now - since < self.timeout + GRACE_SECONDS:
                    continue
                why = f"excluded from epoch {latest} by the members and still running"
                sig, doing = signal.SIGTERM, f"stopping it (SIGKILL after {self.KILL_GRACE:.0f} s)"
            else:
                self.excluded_since.pop(name, None)
                continue
            if not self.store.check([f"dead/{name}"]):
                self.store.set(f"dead/{name}", why)  # the members drop it now, not at their own timeout
            if name in silent and self.islands is not None and self.islands.whole:
                # its island leaves with it: flag the mates too (the leader is the member the others wait for),
                # not after the kill's exit is polled (the chaos run's frozen followers cost 0.3-0.8 s that way)
                for m in running:
                    if m is not w and self.islands.same(m, w) and not self.store.check([f"dead/{_name(m)}"]):
                        self.store.set(f"dead/{_name(m)}", f"its island lost {name}")
            if sig == signal.SIGKILL and stacks.request(w.proc.pid):  # what it was doing, in its log, then the kill
                print(
                    f"islands: worker {name}: {why}; killing it (its threads' stacks: {w.log})",
                    file=self.out,
                    flush=True,
                )
                self.termed[name] = now - self.KILL_GRACE + stacks.DUMP_S  # the SIGKILL goes out DUMP_S later
                continue
            print(f"islands: worker {name}: {why}; {doing}", file=self.out, flush=True)
            signal_worker(w, sig)
            self.termed[name] = now
