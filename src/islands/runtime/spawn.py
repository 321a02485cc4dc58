"""Start islands' own worker processes from a preloaded fork server instead of fresh interpreters.

A worker (`python -m islands ...`, the job host) spends 2-3 s of CPU importing torch and islands before it
does anything; a launcher of 4 workers pays that 4 times, and an elastic island restarted after a failure
pays it again before it can rejoin (the chaos experiment's restarts took 18-25 s on a 2-core machine). So
the launcher asks a fork server that imported them once (multiprocessing's "forkserver", with PRELOAD) for
a copy. The server only imports: no collective, no parallel region, no CUDA call happens in it, so each
copy is as clean as a new interpreter (should an imported library have initialised CUDA after all, each copy
execs a fresh interpreter instead: a forked process cannot use CUDA then). A copy then behaves as `subprocess.Popen` would have made it: its
own session (start_new_session), stdin from /dev/null, stdout and stderr on the descriptors given, the
environment given and nothing else, `sys.argv` as `-m` sets it, the same command line in `ps` (setproctitle),
atexit handlers run at the end, and an exit code that is the process's (negative: killed by that signal).
Two things differ: its parent is the fork server, not the launcher, and /proc/PID/environ shows the
server's environment (os.environ is the one given); find a worker by its log (/proc/PID/fd/1) instead.

Only `[sys.executable, "-m", "islands...", ...]` is forked; anything else (a user's script, a command
wrapped to run inside a testbed's network namespace) is started with subprocess.Popen. ISLANDS_SPAWN=exec
turns the fork server off (every process a fresh interpreter).
"""

from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
import multiprocessing
from multiprocessing import context as mp_context
from multiprocessing import forkserver, popen_forkserver, reduction, util
from multiprocessing import process as mp_process
from multiprocessing import spawn as mp_spawn

import setproctitle

from islands.runtime.netns import enter as enter_netns
from islands.testbed.system import netns_exec_prefix

SPAWN_ENV = "ISLANDS_SPAWN"  # "exec": never fork (default "fork": fork islands' own modules)
# torch._dynamo: torch's DDP constructor imports it (794 modules, 2.1 s of CPU on this machine) in every worker; in a
# restarted island that import ran beside the others' training and held the leader silent past the heartbeat
# timeout (session 21's full chaos run: its one false death, its stack in torch._dynamo's imports)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "islands.cli", "islands.app.elastic_worker",
           "islands.runtime.job_host"]
_more: list[str] = []  # a job's own heavy imports (preload())

_lock = threading.Lock()
_context = None
_unavailable: list[str] = []  # why the fork server cannot be used in this Python, once found


def forks(argv: list[str], env: dict | None = None) -> bool:
    """Whether start() forks `argv` from the fork server (islands' own modules, run by this interpreter)."""
    env = os.environ if env is None else env
    return (env.get(SPAWN_ENV, "fork") != "exec" and not _unavailable and len(argv) >= 3 and argv[0] == sys.executable
            and argv[1] == "-m" and (argv[2] == "islands" or argv[2].startswith("islands.")))


def start(argv: list[str], env: dict, stdout=None, stderr=None, cwd: str | None = None, netns: str | None = None):
    """Start `argv` in a session of its own with stdin from /dev/null; `stdout`/`stderr`: an open file,
    subprocess.STDOUT (stderr only) or None (this process's); `netns`: a named network namespace to run it in
    (a testbed's host: a forked copy enters it itself, anything else runs under `ip netns exec`). Returns a
    subprocess.Popen or a ForkedProcess (the same poll, wait, returncode, pid, send_signal, kill, terminate)."""
    def fresh():
        command = netns_exec_prefix(netns) + list(argv) if netns else argv
        return subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, cwd=cwd,
                                start_new_session=True)

    if not forks(argv, env):
        return fresh()
    out = 1 if stdout is None else stdout.fileno()
    err = out if stderr is subprocess.STDOUT else (2 if stderr is None else stderr.fileno())
    try:
        return ForkedProcess(argv[2], list(argv[3:]), dict(env), out, err, cwd, netns)
    except (AttributeError, TypeError) as e:  # multiprocessing's internals moved (another Python): no fork server
        warnings.warn(f"islands: workers start as fresh interpreters (the fork server is unavailable: {e})",
                      RuntimeWarning, stacklevel=2)
        _unavailable.append(str(e))  # said once; from now on every worker is a fresh interpreter
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


class _Popen(popen_forkserver.Popen):
    """multiprocessing's forkserver Popen, without re-running this process's __main__ in the child: the
    child runs an islands module, not the caller's program (a user's script that launches would otherwise
    start again inside every worker)."""

    def _launch(self, process_obj):
        prep_data = mp_spawn.get_preparation_data(process_obj._name)
        prep_data.pop("init_main_from_path", None)
        prep_data.pop("init_main_from_name", None)
        buf = io.BytesIO()
        mp_context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            mp_context.set_spawning_popen(None)
        self.sentinel, w = forkserver.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)  # as the stdlib does: the child's sentinel of this process
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _ServerProcess(mp_context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


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
    """A worker forked from the fork server, driven like a subprocess.Popen."""

    def __init__(self, module: str, args: list[str], env: dict, out: int, err: int, cwd: str | None,
                 netns: str | None = None):
        _forkserver()
        self._process = _ServerProcess(target=_child, args=(module, args, env, _Fd(out), _Fd(err), cwd, netns),
                                       name=f"islands-{module}")
        self._process.start()
        # not multiprocessing's child to look after: its exit handler would wait for it (or kill it) when
        # this process exits, and a worker must outlive a launcher that dies (docs/membership.md)
        mp_process._children.discard(self._process)
        self._popen = self._process._popen
        self.pid = self._process.pid
        self.args = [sys.executable, "-m", module, *args]

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def poll(self) -> int | None:
        return self._popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            while self._popen.wait(1.0) is None:
                pass
        elif self._popen.wait(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._popen.returncode

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


def _stream(fd: int):
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                            line_buffering=True, write_through=True)


def _server_touched_cuda() -> bool:
    """Whether something the fork server imported initialised CUDA (a library calling torch.cuda at import): a
    forked child could then not use the GPU ("Cannot re-initialize CUDA in forked subprocess")."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _child(module: str, args: list[str], env: dict, out: int, err: int, cwd: str | None,
           netns: str | None = None) -> None:
    """In the forked copy: become what `python -m module args` in a new session would have been."""
    if netns:  # before anything opens a socket; the copy has one thread, so the whole process moves
        enter_netns(netns)
    # `ps`, `pgrep -f` and /proc/PID/cmdline show the command it stands for, not the fork server's; first,
    # while the inherited environment is in place (setproctitle finds argv's memory through it)
    setproctitle.setproctitle(" ".join([sys.executable, "-m", module, *args]))
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {null, out, err} - {0, 1, 2}:
        os.close(fd)
    sys.stdout = sys.__stdout__ = _stream(1)
    sys.stderr = sys.__stderr__ = _stream(2)
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a new interpreter has them
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if _server_touched_cuda():  # a forked copy cannot use CUDA then: become a fresh interpreter instead
        os.execve(sys.executable, [sys.executable, "-m", module, *args], env)
    # the server imported the module already (PRELOAD); `-m` runs it again as __main__, which is what we want
    warnings.filterwarnings("ignore", message=".*found in sys.modules.*", category=RuntimeWarning)
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback on stderr, exit 1
        traceback.print_exc()
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
    """What this process looks like to a worker: `python -m islands.runtime.spawn [ARGS]` prints it (one JSON
    line), forked or not, to check what a worker started by start() gets. `imported`: those of the modules named
    in SPAWN_MODULES (comma-separated) that were imported before this process ran anything (preload())."""
    asked = [m for m in os.environ.get("SPAWN_MODULES", "").split(",") if m]
    return json.loads(json.dumps({"pid": os.getpid(), "session": os.getsid(0), "argv": sys.argv[1:],
                                  "cwd": os.getcwd(), "env": dict(os.environ), "stdin": sys.stdin.read(),
                                  "parent": os.getppid(), "netns": os.readlink("/proc/self/ns/net"),
                                  "imported": [m for m in asked if m in sys.modules]}))


if __name__ == "__main__":  # SPAWN_SLEEP=S: then sleep S seconds; SPAWN_EXIT=CODE: then exit with it
    print(json.dumps(describe_self()), flush=True)
    time.sleep(float(os.environ.get("SPAWN_SLEEP", "0")))
    code = os.environ.get("SPAWN_EXIT", "0")
    sys.exit(int(code) if code.lstrip("-").isdigit() else code)
