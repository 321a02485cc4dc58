"""Start N ranks of any command on this machine (or one per testbed host) and watch them.

Each rank is a plain process joining through torch's env:// rendezvous, exactly as under torchrun, so
the same program runs under both. The launcher's only job is supervision: if any rank exits non-zero
or is killed, the others are stopped at once, the failed rank's log tail is shown, and the job exits
non-zero. Ranks blocked in a collective are additionally bounded by their collective timeout.

    code = launch_ranks([sys.executable, "train.py", "--lr", "3e-4"], 4, islands=2, run_dir=Path("runs/a"))

Every rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
OMP_NUM_THREADS, PYTHONUNBUFFERED=1 and ISLANDS_ISLANDS (read by islands.runtime.world.init_world).
On this machine the launcher owns the rendezvous port: it hosts the env:// store itself (a TCPStore on port 0,
or on the port asked for, bound before any rank starts) and every rank, rank 0 included, connects to it as a
client (TORCHELASTIC_USE_AGENT_STORE=True, as torchrun's agent does). A port picked and freed for rank 0 to
bind later could be taken by another process meanwhile (rank 0 then died with EADDRINUSE); a port held from
the start cannot, so concurrent jobs never collide. On a testbed, rank 0 still hosts the store inside host 0.
All ranks run on this machine, so LOCAL_RANK = RANK even inside testbed hosts (a GPU per rank).
Rank r writes RUN_DIR/logs/rank<r>.log; rank 0's stdout stays on the launcher's stdout.
"""

from __future__ import annotations

import datetime
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from islands.runtime.cross import DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_TIMEOUT_S, CrossSpec, mark_gone
from islands.runtime.elastic.membership import TOKEN_ENV
from islands.runtime.launch import spawn
from islands.testbed import Testbed, TestbedError, TestbedNotFound
from islands.testbed.system import list_netns, require_root

GRACE_SECONDS = 5.0  # SIGTERM, then SIGKILL: a rank stuck in a collective must not hold the job
LOOPBACK = "127.0.0.1"
ISLANDS_ENV = "ISLANDS_ISLANDS"  # the variable islands.runtime.world.init_world reads


class LaunchError(RuntimeError):
    """Launch input that cannot work (a busy port, a testbed that does not exist, bad counts); the CLI
    prints it and exits 2 before any rank starts."""


AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"  # torch's env:// then connects every rank to MASTER_PORT as a client


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


@dataclass
class WorkerProcess:
    rank: int
    proc: subprocess.Popen  # or a spawn.ForkedProcess, driven the same way
    log: Path
    own_group: bool = False  # started in its own process group: stopping it stops its children too


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def signal_worker(w: WorkerProcess, sig: int) -> None:
    """Send `sig` to a worker (its whole process group when it has one); nothing if it is gone."""
    try:
        if w.own_group:
            os.killpg(w.proc.pid, sig)
        else:
            w.proc.send_signal(sig)
    except ProcessLookupError:
        pass


def stop_all(workers: list[WorkerProcess]) -> None:
    """SIGTERM every rank still running, SIGKILL what is left after GRACE_SECONDS."""
    for w in workers:
        if w.proc.poll() is None:
            signal_worker(w, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for w in workers:
        try:
            w.proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            signal_worker(w, signal.SIGKILL)
            w.proc.wait()


def describe_exit(code: int, note: str = "") -> str:
    """`code` in words; `note`: why it is not known exactly (spawn.ForkedProcess.note), added when there is one."""
    if note:
        return f"exit code {code}: {note}"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def exit_of(proc) -> str:
    """How a worker's process ended, in words."""
    return describe_exit(proc.returncode, getattr(proc, "note", ""))


# ---- where ranks run -------------------------------------------------------------------------
def load_testbed(name: str) -> Testbed:
    """The testbed `name`, checked to be usable: it exists, its namespaces are there, we are root."""
    try:
        bed = Testbed.load(name)
        require_root()  # `ip netns exec` needs it
        present = set(list_netns())
    except (TestbedNotFound, ValueError, PermissionError, TestbedError) as e:
        raise LaunchError(str(e)) from None
    missing = [h.netns for h in bed.hosts if h.netns not in present]
    if bed.phase != "up" or missing:
        raise LaunchError(
            f"testbed {name!r} is not up (phase {bed.phase!r}, missing namespaces: "
            f"{', '.join(missing) or 'none'}); see `islands testbed status`, rebuild it with "
            f"`islands testbed up --name {name} --hosts {len(bed.hosts)} --rate {bed.rate}`"
        )
    return bed


@dataclass(frozen=True)
class Placement:
    """Where each rank runs and how it finds rank 0: this machine's loopback, or round-robin over the hosts
    of a testbed (rank r inside host r % hosts, gloo bound to that host's link, MASTER_ADDR on host 0)."""

    master_addr: str
    port: int
    testbed: Testbed | None = field(default=None, compare=False)
    store: object = field(default=None, compare=False, repr=False)  # the launcher's own rendezvous store, if any

    @classmethod
    def loopback(cls, port: int = 0) -> Placement:
        """On this machine, with the rendezvous store listening (in this process) before anything starts: on
        `port`, or on a port the kernel picks (0). The port is held for as long as the placement lives."""
        if port and not 0 < port < 65536:
            raise LaunchError(f"port must be in 1..65535 (or 0 to pick a free one); got {port}")
        if port and not port_is_free(port):
            raise LaunchError(f"port {port} is busy on {LOOPBACK}; choose another or use port 0 to pick a free one")
        store = rendezvous_store(port)
        return cls(LOOPBACK, store.port, store=store)

    @classmethod
    def on_testbed(cls, testbed: str | Testbed, port: int = 0) -> Placement:
        if port:
            raise LaunchError(f"the port is chosen inside the testbed; leave port 0 with a testbed (got {port})")
        bed = load_testbed(testbed) if isinstance(testbed, str) else testbed
        return cls(bed.master_addr, bed.free_port(0), bed)

    def command(self, rank: int, argv: list[str]) -> list[str]:
        if self.testbed is None:
            return list(argv)
        return self.testbed.wrap(self.testbed.host_for_rank(rank), argv)

    def env(self, rank: int) -> dict[str, str]:
        extra = {} if self.testbed is None else self.testbed.env(self.testbed.host_for_rank(rank))
        if self.store is not None:
            extra[AGENT_STORE_ENV] = "True"
        return {**extra, "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.port)}


STORE_TIMEOUT_S = 300.0  # the launcher's store's own operations (it makes none; a rank's come with their own)


def rendezvous_store(port: int = 0):
    """A TCPStore server for the ranks' env:// rendezvous, in this process, on `port` (0: the kernel picks one,
    so no other process can take it between the choice and the use). LaunchError when `port` is busy."""
    from torch.distributed import TCPStore  # torch only where a launcher hosts the store (the module stays light)

    try:
        return TCPStore(
            LOOPBACK, port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S)
        )
    except RuntimeError as e:  # DistNetworkError: EADDRINUSE (another process took it meanwhile)
        raise LaunchError(
            f"port {port} is busy on {LOOPBACK}; choose another or use port 0 to pick a free one ({e})"
        ) from None


def rank_env(rank: int, workers: int, placement: Placement, islands: int = 1, threads: int = 1) -> dict[str, str]:
    """The variables one rank gets on top of the launcher's environment."""
    return {
        **placement.env(rank),
        "RANK": str(rank),
        "WORLD_SIZE": str(workers),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(workers),
        ISLANDS_ENV: str(islands),
        "OMP_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
    }


def check_counts(workers: int, islands: int, threads: int) -> None:
    for name, value in (("workers", workers), ("islands", islands), ("threads", threads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LaunchError(f"{name} must be an integer >= 1; got {value!r}")
    if workers % islands:
        divisors = [d for d in range(1, workers + 1) if workers % d == 0]
        raise LaunchError(
            f"workers ({workers}) must be divisible by islands ({islands}); islands can be one of {divisors}"
        )


# ---- the job ---------------------------------------------------------------------------------
def job_token(run_dir: Path, out, what: str) -> str:
    """The job's shared secret: ISLANDS_TOKEN when set, else a new one written to RUN_DIR/token (mode 0600), which
    `islands join` (elastic jobs) or a restarted island (ISLANDS_TOKEN) needs to take part."""
    token = os.environ.get(TOKEN_ENV, "")
    if token:
        return token
    token = secrets.token_hex(16)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    path = Path(run_dir) / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    print(f"islands: {what} token written to {path} (mode 0600)", file=out)
    return token


def launch_ranks(
    argv: list[str],
    workers: int,
    *,
    islands: int = 1,
    testbed: str | Testbed | None = "",
    port: int = 0,
    threads: int = 1,
    run_dir: Path,
    out=None,
) -> int:
    """Run `argv` as ranks 0..workers-1 and supervise them; returns the exit code for the CLI (0 when every
    rank exited 0, 1 when one failed, 130/143 when the launcher was interrupted or terminated).

    `testbed`: a testbed's name (or a loaded Testbed) to run each rank inside one of its hosts; `port`: the
    rendezvous port (0: a free one; refused if busy). Raises LaunchError before starting anything when the
    input cannot work."""
    out = sys.stderr if out is None else out
    if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
        raise LaunchError(f"argv must be a non-empty list of strings; got {argv!r}")
    check_counts(workers, islands, threads)
    placement = Placement.on_testbed(testbed, port) if testbed else Placement.loopback(port)
    return run_ranks(argv, workers, placement, islands=islands, threads=threads, run_dir=run_dir, out=out)


def run_island_jobs(
    argv: list[str],
    workers: int,
    islands: int,
    *,
    threads: int = 1,
    run_dir: Path,
    out=None,
    cross_timeout_s: float | None = None,
    heartbeat_timeout_s: float | None = None,
) -> int:
    """`islands` jobs of `workers // islands` ranks each on this machine, each its own rendezvous (its own store and
    MASTER_PORT, as a torchrun per island would give), joined across by islands.runtime.cross through a store this
    launcher hosts (ISLANDS_CROSS_*). An island whose rank fails is stopped alone: the others train on without it
    (their cross-island group drops it: the launcher sets its dead flag, mark_gone). The islands sign the cross store
    and tag their payloads with ISLANDS_TOKEN, or a token made for the job (RUN_DIR/token). Island i's rank r logs
    to RUN_DIR/logs/island<i>/rank<r>.log. Returns 0 when every rank of every island exited 0, else 1 (130/143
    when interrupted or terminated)."""
    out = sys.stderr if out is None else out
    check_counts(workers, islands, threads)
    k = workers // islands
    cross = rendezvous_store(0)  # held for the job's life: the islands' meeting point outlives any island
    timeout = cross_timeout_s if cross_timeout_s is not None else DEFAULT_TIMEOUT_S
    heartbeat = heartbeat_timeout_s if heartbeat_timeout_s is not None else DEFAULT_HEARTBEAT_TIMEOUT_S
    token = job_token(run_dir, out, "islands' cross-store")
    jobs: list[list[WorkerProcess]] = []
    placements: list[Placement] = []  # each island's rendezvous store, held (served) for the job's life
    specs: list[CrossSpec] = []

    def gone(i: int) -> None:
        try:
            mark_gone(specs[i], k)
        except Exception as e:  # noqa: BLE001 - the others still find it by its heartbeat; say why not sooner
            print(f"islands: could not mark island {i} gone in the cross store ({e})", file=out, flush=True)

    def start_and_supervise() -> int:
        for i in range(islands):
            placement = Placement.loopback()  # the island's own rendezvous store and port
            placements.append(placement)
            spec = CrossSpec(
                f"{LOOPBACK}:{cross.port}",
                islands,
                i,
                host_store=False,
                timeout_s=timeout,
                heartbeat_timeout_s=heartbeat,
                token=token,
            )
            specs.append(spec)
            logs = Path(run_dir) / "logs" / f"island{i}"
            logs.mkdir(parents=True, exist_ok=True)
            # each island's rank 0 prints to the launcher's stdout, the rest to their logs
            jobs.append([_start(r, argv, k, placement, 1, threads, logs, spec.env()) for r in range(k)])
        return _supervise_islands(jobs, out, gone)

    return _run_supervised(start_and_supervise, lambda: [w for job in jobs for w in job], "island", out)


def _supervise_islands(jobs: list[list[WorkerProcess]], out, gone: Callable[[int], None]) -> int:
    """Wait for every rank of every island; a rank that fails stops its own island only (as torchrun stops a job
    whose worker failed), `gone(island)` tells the others, and they go on."""
    exits: queue.Queue = queue.Queue()
    island_of = {}
    for i, job in enumerate(jobs):
        for w in job:
            island_of[id(w)] = i
            threading.Thread(target=_watch, args=(w, exits), name=f"islands-i{i}r{w.rank}", daemon=True).start()
    failed: set[int] = set()
    for _ in range(sum(len(job) for job in jobs)):
        while True:
            try:
                w = exits.get(timeout=0.5)
                break
            except queue.Empty:
                continue
        i = island_of[id(w)]
        if w.proc.returncode != 0 and i not in failed:
            failed.add(i)
            stop_all(jobs[i])
            gone(i)
            print(
                f"\nislands: island {i}'s rank {w.rank} failed ({exit_of(w.proc)}); stopped island {i}, the other "
                f"islands go on without it.",
                file=out,
            )
            print(f"--- last lines of its log ({w.log}) ---\n{log_tail(w.log)}", file=out, flush=True)
    if failed:
        print(f"islands: island(s) {sorted(failed)} failed; {len(jobs) - len(failed)} finished", file=out, flush=True)
    return 1 if failed else 0


class _Terminated(Exception):
    """SIGTERM reached the launcher: stop every rank, as on Ctrl-C."""


def _raise_terminated(signum, frame):
    raise _Terminated()


def _handlers() -> dict:
    """The launcher's SIGINT and SIGTERM handlers, to change and restore; {} off the main thread (where Python
    cannot set them) or when one was set outside Python (not restorable)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    return saved if None not in saved.values() else {}


def _install(handlers: dict, saved: dict) -> None:
    if saved:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def run_ranks(
    argv: list[str],
    workers: int,
    placement: Placement,
    *,
    islands: int = 1,
    threads: int = 1,
    run_dir: Path,
    out=None,
    env: dict[str, str] | None = None,
) -> int:
    """launch_ranks once the placement is chosen (the app layer places a testbed job itself to read its
    wire counters around the run). `env`: variables every rank gets on top of the launcher's."""
    out = sys.stderr if out is None else out
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started: list[WorkerProcess] = []

    def start_and_supervise() -> int:
        for rank in range(workers):
            started.append(_start(rank, argv, workers, placement, islands, threads, logs, env or {}))
        return _supervise(started, out)

    return _run_supervised(start_and_supervise, lambda: started, "rank", out)


def _run_supervised(body: Callable[[], int], processes: Callable[[], list[WorkerProcess]], what: str, out) -> int:
    """`body` (start the processes and supervise them) with Ctrl-C and SIGTERM stopping every one of
    `processes()`: 130 or 143 then, else what `body` returns; a fork server left stopped is released."""
    saved = _handlers()
    _install({signal.SIGTERM: _raise_terminated}, saved)
    try:
        return body()
    except KeyboardInterrupt:
        print(f"islands: interrupted; stopping every {what}", file=out, flush=True)
        return 130
    except _Terminated:
        print(f"islands: terminated; stopping every {what}", file=out, flush=True)
        return 128 + signal.SIGTERM
    finally:
        # A second Ctrl-C or SIGTERM must not cut the stop short: the ranks run in their own sessions and
        # would outlive the launcher.
        _install({signal.SIGINT: signal.SIG_IGN, signal.SIGTERM: signal.SIG_IGN}, saved)
        try:
            stop_all(processes())
            spawn.release_stopped_server(out)
        finally:
            _install(saved, saved)


def _start(
    rank: int,
    argv: list[str],
    workers: int,
    placement: Placement,
    islands: int,
    threads: int,
    logs: Path,
    extra: dict[str, str],
) -> WorkerProcess:
    env = {**os.environ, **extra, **rank_env(rank, workers, placement, islands, threads)}
    log = logs / f"rank{rank}.log"
    with open(log, "w") as f:
        stdout = None if rank == 0 else f  # rank 0 talks to the user; its stderr (errors) is in its log
        # Its own session: Ctrl-C reaches the launcher only, which then stops every rank (and their children).
        proc = spawn.start(placement.command(rank, argv), env, stdout=stdout, stderr=f)
    return WorkerProcess(rank, proc, log, own_group=True)


def _watch(w: WorkerProcess, exits: queue.Queue) -> None:
    w.proc.wait()
    if w.own_group:  # what the rank left behind (a data loader worker) goes with it; its pid was just reaped
        signal_worker(w, signal.SIGKILL)
    exits.put(w)


def _supervise(workers: list[WorkerProcess], out) -> int:
    """Wait for every rank; on the first failure stop the rest and show that rank's log tail. A waiter
    thread per rank reports exits in the order they happen, so the blame goes to the rank that failed
    first, not to a peer that died of its connection reset a moment later."""
    exits: queue.Queue = queue.Queue()
    for w in workers:
        threading.Thread(target=_watch, args=(w, exits), name=f"islands-rank{w.rank}", daemon=True).start()
    for _ in workers:
        while True:
            try:
                w = exits.get(timeout=0.5)  # a timeout keeps Ctrl-C and SIGTERM prompt
                break
            except queue.Empty:
                continue
        if w.proc.returncode != 0:
            stop_all(workers)
            print(f"\nislands: worker rank {w.rank} failed ({exit_of(w.proc)}); stopped the other workers.", file=out)
            print(f"--- last lines of rank {w.rank}'s log ({w.log}) ---\n{log_tail(w.log)}", file=out, flush=True)
            return 1
    return 0
