"""Start islands' own worker processes from a preloaded fork server instead of fresh interpreters.

A worker (`python -m islands ...`, the job host) spends 2-3 s of CPU importing torch and islands before it
does anything; a launcher of 4 workers pays that 4 times, and an elastic island restarted after a failure
pays it again before it can rejoin (the chaos experiment's restarts took 18-25 s on a 2-core machine). So
the launcher asks a fork server that imported them once (multiprocessing's "forkserver", with PRELOAD) for
a copy. The server only imports: no collective, no parallel region, no CUDA call happens in it, so each
copy is as clean as a new interpreter (should an imported library have initialised CUDA after all, each copy
execs a fresh interpreter instead: a forked process cannot use CUDA then). A copy then behaves as
`subprocess.Popen` would have made it: its own session (start_new_session), stdin from /dev/null, stdout
and stderr on the descriptors given, the environment given and nothing else, `sys.argv` as `-m` sets it, the
same command line in `ps` (setproctitle), atexit handlers run at the end, and an exit code that is the
process's (negative: killed by that signal).
Two things differ: its parent is the fork server, not the launcher, and /proc/PID/environ shows the
server's environment (os.environ is the one given); find a worker by its log (/proc/PID/fd/1) instead.

The launcher never depends on the fork server to learn that a worker ended (issue #33 item 9): the server
only forwards each child's exit status when it reaps it, so a server stopped with SIGSTOP left finished workers
zombies and the launcher waiting for ever, and a killed one read as "exit 255" for workers still running.
ForkedProcess.poll takes the server's word when it comes, and otherwise watches the process itself (a pidfd):
once it has exited, its status comes from the copy's own report (a pipe it writes its exit code to as it
exits, os._exit included) or, while it is an unreaped zombie, from /proc/PID/stat; with neither, it is an
exit of unknown status (UNKNOWN_EXIT, `note` says why), never a wait. A start request the server does not
answer (stopped for STOPPED_LIMIT_S, or silent for START_TIMEOUT_S) gives the server up: it is killed (its
pending request dies with it; the next start gets a new server) and the worker starts as a fresh interpreter.

Only `[sys.executable, "-m", "islands...", ...]` is forked by default; anything else (a user's script, a command
wrapped to run inside a testbed's network namespace) is started with subprocess.Popen. ISLANDS_SPAWN=exec
turns the fork server off (every process a fresh interpreter).

A user's script (`[sys.executable, "train.py", ...]` or `[sys.executable, "-m", "pkg.train", ...]`) is forked too when
its environment names modules to preload (ISLANDS_PRELOAD, comma-separated; `islands run --preload`): a server of its
own imports PRELOAD and those once (or islands' own server, when it imports them anyway), and each rank is a copy that
runs the script as `python train.py` would (sys.argv, sys.path[0] the script's folder, __main__, an uncaught exception
through sys.excepthook, numpy's global generator seeded afresh). The point is the ranks' start-up: `from transformers
import Trainer` is ~5 s of CPU and `import lightning` ~5.5 s on a 2-core machine, paid by every rank and again by every
restarted island before it can rejoin. It is opt-in because a preloaded module was imported once, in the launcher's
environment: what it read from the environment at import time (a library's verbosity or cache variables) is the
launcher's, not a rank's own variables (RANK, ISLANDS_*), and whatever it started at import (a thread) is not in the
copies.
"""

from __future__ import annotations

import atexit
import io
import json
import multiprocessing
import os
import runpy
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from multiprocessing import (
    context as mp_context,
    forkserver,
    popen_forkserver,
    process as mp_process,
    reduction,
    spawn as mp_spawn,
    util,
)
from pathlib import Path

import setproctitle

from islands.runtime.netns import enter as enter_netns
from islands.testbed.system import netns_exec_prefix

SPAWN_ENV = "ISLANDS_SPAWN"  # "exec": never fork (default "fork": fork islands' own modules)
PRELOAD_ENV = "ISLANDS_PRELOAD"  # modules to preload for a user's script, comma-separated: then it is forked too
# torch._dynamo: torch's DDP constructor imports it (794 modules, 2.1 s of CPU on this machine) in every worker; in a
# restarted island that import ran beside the others' training and held the leader silent past the heartbeat
# timeout (session 21's full chaos run: its one false death, its stack in torch._dynamo's imports)
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "numpy",
    "islands.cli",
    "islands.app.elastic_worker",
    "islands.runtime.launch.job_host",
    "islands.checkpoint.codec.kernels_loaded",  # the codec's numba loops, loaded once: ~1.5 CPU-s per saving worker
]
_more: list[str] = []  # a job's own heavy imports (preload())

START_TIMEOUT_S = 120.0  # a start request unanswered this long gives the server up (its first start imports torch)
STOPPED_LIMIT_S = 2.0  # ... and one to a server stopped (SIGSTOP) this long
SERVER_GRACE_S = 2.0  # a worker that exited and was reaped: how long its status may take to come from the server
UNKNOWN_EXIT = 255  # the exit code of a worker whose status nobody could tell (its server was killed, no report)
_REPORT = struct.Struct("=qi")  # what a copy writes as it exits: its pid and its exit status

_lock = threading.Lock()
_context = None
_script_servers: dict[tuple[str, ...], forkserver.ForkServer] = {}  # a server per preload list of scripts
_unavailable: list[str] = []  # why the fork server cannot be used in this Python, once found


def script_preload(env: Mapping[str, str]) -> tuple[str, ...]:
    """The modules `env` asks a user's script's server to preload (ISLANDS_PRELOAD), in order, without repeats."""
    names = [m.strip() for m in env.get(PRELOAD_ENV, "").split(",")]
    return tuple(dict.fromkeys(m for m in names if m))


def _target(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """What `argv` runs, when this interpreter runs it plainly: ("module", name, args) for `python -m name args`,
    ("path", script, args) for `python script args`; None for anything else (another program, interpreter
    options such as -u or -X, which a copy could not take on)."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    if argv[1] == "-m":
        return ("module", argv[2], list(argv[3:])) if len(argv) >= 3 else None
    if argv[1].startswith("-"):
        return None
    return "path", argv[1], list(argv[2:])


def _islands_module(name: str) -> bool:
    return name == "islands" or name.startswith("islands.")


def _user_code(kind: str, name: str) -> bool:
    """Whether target (kind, name) is a user's script or module rather than one of islands' own modules."""
    return not (kind == "module" and _islands_module(name))


def forks(argv: list[str], env: Mapping[str, str] | None = None) -> bool:
    """Whether start() forks `argv` from a fork server: islands' own modules, run by this interpreter; and a user's
    script or module when `env` names modules to preload for it (ISLANDS_PRELOAD)."""
    environ: Mapping[str, str] = os.environ if env is None else env
    target = _target(argv)
    if environ.get(SPAWN_ENV, "fork") == "exec" or _unavailable or target is None:
        return False
    kind, name, _ = target
    return not _user_code(kind, name) or bool(script_preload(environ))


def start(argv: list[str], env: dict, stdout=None, stderr=None, cwd: str | None = None, netns: str | None = None):
    """Start `argv` in a session of its own with stdin from /dev/null; `stdout`/`stderr`: an open file,
    subprocess.STDOUT (stderr only) or None (this process's); `netns`: a named network namespace to run it in
    (a testbed's host: a forked copy enters it itself, anything else runs under `ip netns exec`). Returns a
    subprocess.Popen or a ForkedProcess (the same poll, wait, returncode, pid, send_signal, kill, terminate)."""

    def fresh():
        command = netns_exec_prefix(netns) + list(argv) if netns else argv
        return subprocess.Popen(
            command, env=env, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True
        )

    if not forks(argv, env):
        return fresh()
    target = _target(argv)
    assert target is not None  # forks() said so
    kind, name, args = target
    out = 1 if stdout is None else stdout.fileno()
    err = out if stderr is subprocess.STDOUT else (2 if stderr is None else stderr.fileno())
    server = None  # islands' own workers' server, unless a user's script needs one of its own
    try:
        if _user_code(kind, name):
            server = _script_server(script_preload(env))
        return ForkedProcess(name, args, dict(env), out, err, cwd, netns, kind=kind, server=server)
    except (AttributeError, TypeError) as e:  # multiprocessing's internals moved (another Python): no fork server
        warnings.warn(
            f"islands: workers start as fresh interpreters (the fork server is unavailable: {e})",
            RuntimeWarning,
            stacklevel=2,
        )
        _unavailable.append(str(e))  # said once; from now on every worker is a fresh interpreter
        return fresh()
    except (ServerUnresponsive, EOFError, OSError) as e:  # stopped, hung or killed: this worker starts without it
        print(f"islands: {e}; this worker starts as a fresh interpreter", file=sys.stderr, flush=True)
        _abandon_server(server)
        return fresh()


def preload(modules) -> None:
    """Have the fork server import `modules` too: a job's heavy imports (its task's data library, its model's
    package), so that a forked worker does not import them itself after its heartbeat thread has started. An
    import holds the GIL for long stretches and the beats wait (beside 4 busy processes, importing
    scikit-learn stretched a 0.2 s tick to 0.5 s; docs/membership.md, chaos run 10). Takes effect
    for a fork server not started yet; a module that is not installed is skipped (the server ignores its
    ImportError, and the worker then fails on it where it would have anyway)."""
    with _lock:
        _more.extend(m for m in modules if m not in _more and m not in PRELOAD)


def _forkserver():
    global _context
    with _lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD + _more)
            _context = ctx
        return _context


def _script_server(modules: tuple[str, ...]) -> forkserver.ForkServer | None:
    """The fork server for users' scripts that preload `modules`: islands' own workers' one (None) when it imports
    them all (it runs already, or will, for an elastic job's host: no second server to start), else one per list,
    started on its first request."""
    own = forkserver._forkserver
    preloaded = own._preload_modules if _server_pid() is not None else [*PRELOAD, *_more]  # type: ignore[attr-defined]
    if all(any(p == m or p.startswith(m + ".") for p in preloaded) for m in modules):  # a package with its module
        return None
    with _lock:
        server = _script_servers.get(modules)
        if server is None:
            server = _script_servers[modules] = forkserver.ForkServer()
            server.set_forkserver_preload(list(dict.fromkeys([*PRELOAD, *_more, *modules])))
        return server


class _Popen(popen_forkserver.Popen):
    """multiprocessing's forkserver Popen, without re-running this process's __main__ in the child: the
    child runs an islands module or a user's script, not the caller's program (a user's script that launches would
    otherwise start again inside every worker); and asking the process's own server (its `server`), which is
    multiprocessing's one unless it names another."""

    def __init__(self, process_obj):
        self.server: forkserver.ForkServer = process_obj.server or forkserver._forkserver
        super().__init__(process_obj)

    def _launch(self, process_obj):
        prep_data = mp_spawn.get_preparation_data(process_obj._name)
        prep_data.pop("init_main_from_path", None)
        prep_data.pop("init_main_from_name", None)
        if process_obj.user_code:  # a user's script: the server's own sys.path, as a fresh interpreter's
            prep_data.pop("sys_path", None)
        buf = io.BytesIO()
        mp_context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            mp_context.set_spawning_popen(None)
        self.sentinel, w = self.server.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)  # as the stdlib does: the child's sentinel of this process
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = _await_pid(self.sentinel, self.server)


class ServerUnresponsive(RuntimeError):
    """The fork server did not answer a start request (stopped with SIGSTOP, or hung)."""


def _server_pid(server: forkserver.ForkServer | None = None) -> int | None:
    """The pid of `server` (default multiprocessing's own, which islands' workers use), None while not running."""
    return getattr(server or forkserver._forkserver, "_forkserver_pid", None)


def _await_pid(sentinel: int, server_of: forkserver.ForkServer | None = None) -> int:
    """The new child's pid, as the server sends it; never a wait without end: ServerUnresponsive when the server
    stays stopped for STOPPED_LIMIT_S or silent for START_TIMEOUT_S, EOFError when it died."""
    server = _server_pid(server_of)
    now = time.monotonic()
    deadline, stopped_since = now + START_TIMEOUT_S, None
    while not select.select([sentinel], [], [], 0.05)[0]:
        now = time.monotonic()
        stopped = server is not None and process_state(server) in ("T", "t")
        stopped_since = (stopped_since or now) if stopped else None
        if stopped_since is not None and now - stopped_since > STOPPED_LIMIT_S:
            raise ServerUnresponsive(
                f"the fork server (pid {server}) is stopped and did not start a worker within {STOPPED_LIMIT_S:.0f} s"
            )
        if now > deadline:
            raise ServerUnresponsive(
                f"the fork server (pid {server}) did not start a worker within {START_TIMEOUT_S:.0f} s"
            )
    return forkserver.read_signed(sentinel)


def _abandon_server(server_of: forkserver.ForkServer | None = None) -> None:
    """Kill a fork server that failed to answer: its pending start requests die with it (no late copy of a worker
    the launcher gave up on), its children (running workers) live on, and the next start gets a new server
    (multiprocessing starts one when it finds the old one dead)."""
    server = _server_pid(server_of)
    if server is None:
        return
    try:
        os.kill(server, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 2.0
    while process_state(server) not in (None, "Z", "X") and time.monotonic() < deadline:
        time.sleep(0.01)


def release_stopped_server(out=None) -> bool:
    """At the end of a job: a fork server left stopped (SIGSTOP) would hold its exited children as zombies for as
    long as it stays stopped; it is killed instead (a later start gets a new one). Returns whether one was."""
    released = False
    for server_of in [None, *_script_servers.values()]:
        server = _server_pid(server_of)
        if server is None or process_state(server) not in ("T", "t"):
            continue
        print(
            f"islands: the fork server (pid {server}) is stopped; ending it so that its exited workers are reaped",
            file=out if out is not None else sys.stderr,
            flush=True,
        )
        _abandon_server(server_of)
        released = True
    return released


def process_state(pid: int) -> str | None:
    """The state letter of process `pid` in /proc (R, S, D, T, t, Z, ...), or None when there is no such process."""
    fields = _stat(pid)
    return fields[0] if fields else None


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the state on (field 3 is [0]), or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return text.rpartition(")")[2].split()


def zombie_status(pid: int) -> int | None:
    """The exit code (Popen's convention) of `pid` while it is a zombie nobody reaped (its parent is stopped), read
    from /proc/PID/stat's exit_code field; None when it is not a zombie (running, or reaped)."""
    fields = _stat(pid)
    if not fields or fields[0] != "Z" or len(fields) < 50:
        return None
    try:
        return os.waitstatus_to_exitcode(int(fields[49]))
    except ValueError:
        return None


class _ServerProcess(mp_context.ForkServerProcess):
    server: forkserver.ForkServer | None = None  # the server to ask (None: multiprocessing's own)
    user_code = False  # it runs a user's script or module (not islands' own)

    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)

    def __getstate__(self):  # the copy gets what to run, not the launcher's handle on a server (it holds a lock)
        return {**self.__dict__, "server": None}


class _Fd:
    """A descriptor of this process that the fork server's child receives as its own (over the server's socket)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _Fd._opened, (reduction.DupFd(self.fd),)

    @staticmethod
    def _opened(dup) -> int:
        return dup.detach()


class ForkedProcess:
    """A worker forked from the fork server, driven like a subprocess.Popen. Its exit is learned without relying on
    the server (module docstring): poll and wait never wait on a stopped or killed server."""

    def __init__(
        self,
        name: str,
        args: list[str],
        env: dict,
        out: int,
        err: int,
        cwd: str | None,
        netns: str | None = None,
        *,
        kind: str = "module",
        server: forkserver.ForkServer | None = None,
    ):
        """Runs `python -m name args` (kind "module") or `python name args` (kind "path": a script), forked from
        `server` (None: islands' own workers' server)."""
        _forkserver()
        report_r, report_w = os.pipe()  # the copy writes its exit status here as it exits
        target = (kind, name)
        try:
            self._process = _ServerProcess(
                target=_child,
                name=f"islands-{Path(name).stem if kind == 'path' else name}",
                args=(target, args, env, _Fd(out), _Fd(err), cwd, netns, _Fd(report_w), time.time() + START_TIMEOUT_S),
            )
            self._process.server, self._process.user_code = server, _user_code(kind, name)
            self._process.start()
        except BaseException:
            os.close(report_r)
            raise
        finally:
            os.close(report_w)
        # not multiprocessing's child to look after: its exit handler would wait for it (or kill it) when
        # this process exits, and a worker must outlive a launcher that dies (docs/membership.md)
        mp_process._children.discard(self._process)  # type: ignore[attr-defined]  # private, absent from typeshed
        self._popen = self._process._popen  # type: ignore[attr-defined]  # private, absent from typeshed
        pid = self._process.pid
        assert pid is not None  # started above
        self.pid: int = pid
        self.args = _command(target, args)
        os.set_blocking(report_r, False)
        self._report, self._reported = report_r, None
        self._pidfd: int | None
        try:
            self._pidfd = os.pidfd_open(self.pid)  # readable once it has exited, whoever reaps it
        except (AttributeError, OSError):  # no pidfd (old kernel), or gone already: /proc is looked at instead
            self._pidfd = None
        weakref.finalize(self, _close, [fd for fd in (report_r, self._pidfd) if fd is not None])
        self._code: int | None = None
        self._server_gone = False
        self._exited_since: float | None = None
        self.note = ""  # why the exit status is UNKNOWN_EXIT, when it is

    @property
    def returncode(self) -> int | None:
        return self._code

    def poll(self) -> int | None:
        if self._code is None:
            code = self._server_word()
            if code is None and self._exited():
                code = self._without_server()
            if code is not None:
                self._code = self._popen.returncode = code
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = 0.5 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                assert timeout is not None  # time runs out only against a deadline
                raise subprocess.TimeoutExpired(self.args, timeout)
            watched = [
                fd for fd in (None if self._server_gone else self._popen.sentinel, self._pidfd) if fd is not None
            ]
            if self._exited_since is not None or not watched:
                time.sleep(min(0.05, left))  # exited, its status not told yet: look again shortly
            else:
                select.select(watched, [], [], min(0.5, left))
        return code

    def _server_word(self) -> int | None:
        """The exit status the fork server sent (it reaped the child), without waiting; notes a server that died."""
        if self._server_gone or not select.select([self._popen.sentinel], [], [], 0)[0]:
            return None
        try:
            return forkserver.read_signed(self._popen.sentinel)
        except (OSError, EOFError):  # the server died: its children live on, re-parented; watch them ourselves
            self._server_gone = True
            return None

    def _exited(self) -> bool:
        if self._pidfd is not None:
            return bool(select.select([self._pidfd], [], [], 0)[0])
        return process_state(self.pid) in (None, "Z", "X")

    def _own_report(self) -> int | None:
        while True:
            try:
                data = os.read(self._report, _REPORT.size * 64)
            except (BlockingIOError, OSError):
                break
            if not data:
                break
            for off in range(0, len(data) - len(data) % _REPORT.size, _REPORT.size):
                pid, code = _REPORT.unpack_from(data, off)
                if pid == self.pid:
                    self._reported = code
        return self._reported

    def _without_server(self) -> int | None:
        """The status of a process that has exited while the server has not said it: its own report, or its zombie
        status; failing both, UNKNOWN_EXIT once the server is known dead or SERVER_GRACE_S passed."""
        code = self._own_report()
        if code is None:
            code = zombie_status(self.pid)
        if code is not None:
            return code
        now = time.monotonic()
        if self._exited_since is None:
            self._exited_since = now
        if not self._server_gone and now - self._exited_since < SERVER_GRACE_S:
            return None  # reaped by a live server: its word is on the way
        self.note = (
            f"its exit status is unknown: the fork server {'died' if self._server_gone else 'did not report it'}"
            " and the worker did not report one itself (killed by a signal?)"
        )
        return UNKNOWN_EXIT

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _close(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _stream(fd: int):
    """A forked rank's stdout/stderr: flushed at every newline, each line in one write() (print writes the text and
    its newline in two calls; unbuffered, another island's rank 0 sharing the launcher's stdout could land between
    them and two lines would run together)."""
    return io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(fd, "w", closefd=False)),
        encoding="utf-8",
        errors="backslashreplace",
        line_buffering=True,
    )


def _server_touched_cuda() -> bool:
    """Whether something the fork server imported initialised CUDA (a library calling torch.cuda at import): a
    forked child could then not use the GPU ("Cannot re-initialize CUDA in forked subprocess")."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _reporting_exit(report: int) -> None:
    """Make this copy write its exit status to `report` as it exits, whichever way it exits: sys.exit and the end of
    its module go through multiprocessing's os._exit, and a worker may call os._exit itself (the elastic worker
    does). Processes it forks inherit the hook but report nothing (another pid)."""
    os.set_inheritable(report, False)
    me, real_exit = os.getpid(), os._exit

    def _exit(code):
        if os.getpid() == me:
            try:
                os.write(report, _REPORT.pack(me, int(code) & 0xFF))  # the status the kernel keeps
            except (OSError, ValueError, TypeError):
                pass
        real_exit(code)

    os._exit = _exit


def _reseed_numpy() -> None:
    """numpy's global generator was seeded from the OS once, in the server, and every copy would draw the same
    numbers from it; a fresh interpreter seeds its own (Python's `random` reseeds itself at fork already)."""
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()


def _command(target: tuple[str, str], args: list[str]) -> list[str]:
    """The command line a copy running `target` with `args` stands for."""
    kind, name = target
    return [sys.executable, *(["-m", name] if kind == "module" else [name]), *args]


def _child(
    target: tuple[str, str],
    args: list[str],
    env: dict,
    out: int,
    err: int,
    cwd: str | None,
    netns: str | None = None,
    report: int | None = None,
    start_by: float | None = None,
) -> None:
    """In the forked copy: become what `python -m module args` (or `python script args`, target ("path", script))
    in a new session would have been."""
    if start_by is not None and time.time() > start_by:  # the launcher gave this start up (a stopped server)
        os._exit(UNKNOWN_EXIT)
    if report is not None:
        _reporting_exit(report)
    if netns:  # before anything opens a socket; the copy has one thread, so the whole process moves
        enter_netns(netns)
    # `ps`, `pgrep -f` and /proc/PID/cmdline show the command it stands for, not the fork server's; first,
    # while the inherited environment is in place (setproctitle finds argv's memory through it)
    command = _command(target, args)
    setproctitle.setproctitle(" ".join(command))
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {null, out, err} - {0, 1, 2}:
        os.close(fd)
    sys.stdout = sys.__stdout__ = _stream(1)  # type: ignore[misc]  # Final in typeshed; a forked child rebinds it
    sys.stderr = sys.__stderr__ = _stream(2)  # type: ignore[misc]  # Final in typeshed; a forked child rebinds it
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a new interpreter has them
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _reseed_numpy()
    if _server_touched_cuda():  # a forked copy cannot use CUDA then: become a fresh interpreter instead
        if report is not None:
            os.close(report)  # the fresh interpreter reports nothing: its status comes from the server or /proc
        os.execve(sys.executable, command, env)
    kind, name = target
    sys.argv = [name, *args]
    code: str | int | None = 0  # SystemExit's code: an int, None, or a message
    try:
        if kind == "module":
            # the server may have imported it already (PRELOAD); `-m` runs it again as __main__, as we want
            warnings.filterwarnings("ignore", message=".*found in sys.modules.*", category=RuntimeWarning)
            if _user_code(kind, name):  # a user's module: as `python -m` has it (islands' keep the launcher's)
                sys.path[0] = os.getcwd()
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.realpath(name))  # as `python script` has it
            runpy.run_path(name, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - as the interpreter would: sys.excepthook (a traceback, or the one line
        sys.excepthook(*sys.exc_info())  # a library's own hook prints), exit 1
        code = 1
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.exit(code or 0)


def describe_self() -> dict:
    """What this process looks like to a worker: `python -m islands.runtime.launch.spawn [ARGS]` prints it (one JSON
    line), forked or not, to check what a worker started by start() gets. `imported`: those of the modules named
    in SPAWN_MODULES (comma-separated) that were imported before this process ran anything (preload())."""
    asked = [m for m in os.environ.get("SPAWN_MODULES", "").split(",") if m]
    return json.loads(
        json.dumps(
            {
                "pid": os.getpid(),
                "session": os.getsid(0),
                "argv": sys.argv[1:],
                "cwd": os.getcwd(),
                "env": dict(os.environ),
                "stdin": sys.stdin.read(),
                "parent": os.getppid(),
                "netns": os.readlink("/proc/self/ns/net"),
                "imported": [m for m in asked if m in sys.modules],
            }
        )
    )


if __name__ == "__main__":  # SPAWN_SLEEP=S: then sleep S seconds; SPAWN_EXIT=CODE: then exit with it
    print(json.dumps(describe_self()), flush=True)
    time.sleep(float(os.environ.get("SPAWN_SLEEP", "0")))
    code = os.environ.get("SPAWN_EXIT", "0")
    sys.exit(int(code) if code.lstrip("-").isdigit() else code)
