"""What a silent worker was doing when the launcher gave up on it: its process state and its threads' stacks.

A worker whose heartbeat stops for the heartbeat timeout is killed (islands.runtime.launch.elastic._Reaper). When
the worker was in fact alive (a false death: issue #20's start-up deaths, a loaded CI machine) the only evidence
used to be "no heartbeat for 5.1 s". Now the launcher first reads the process's state from /proc (R running, S
sleeping, D waiting on the disk, T stopped) and, when the process catches DUMP_SIGNAL, sends it: faulthandler
writes every thread's Python stack to the worker's stderr (its log) from the signal handler itself, without the
GIL, so a process whose main thread holds the GIL still answers. The SIGKILL follows DUMP_S later.

Workers catch the signal from `enable()`, which joining an elastic job calls (islands.runtime.world). A real-time
signal, not SIGUSR1: a user's script may use SIGUSR1 for its own purposes, and a process that does not catch the
signal is never sent it (its default action would kill it with the wrong exit code).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

DUMP_SIGNAL = signal.SIGRTMIN + 3  # SIGRTMIN..+2 may be glibc's own; Python's SIGRTMIN already skips those
DUMP_S = 0.2  # seconds from the dump signal to SIGKILL: the handler writes at once, a few KB

_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "waiting on I/O",
    "T": "stopped",
    "t": "stopped by a tracer",
    "Z": "exited",
    "X": "exited",
}


def enable(file=None) -> bool:
    """Dump every thread's stack to `file` (stderr) on DUMP_SIGNAL, for as long as the process runs. The handler
    writes to a file descriptor: a stderr replaced by an object without one (pytest's capture, a notebook) falls
    back to the process's original stderr. False if no handler could be installed; the process runs on without."""
    target = sys.stderr if file is None else file
    try:
        target.fileno()
    except (AttributeError, OSError, ValueError):
        target = sys.__stderr__
    try:
        # a fresh registration each time: faulthandler installs its handler only on the first, and since then a
        # framework may have put back what Python's signal module believed was there (Lightning's fit restores every
        # signal's handler at its end, SIG_DFL for this one), which leaves the signal uncaught
        faulthandler.unregister(DUMP_SIGNAL)
        faulthandler.register(DUMP_SIGNAL, file=target, all_threads=True, chain=False)
    except (AttributeError, OSError, ValueError, RuntimeError):
        return False
    return True


def state(pid: int) -> str | None:
    """The process's scheduler state in words ("stopped", "waiting on I/O", ...), None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    code = text.rsplit(")", 1)[-1].split()[0]  # the command name in (...) may hold spaces
    return _STATES.get(code, code)


def cpu_seconds(pid: int) -> float | None:
    """CPU time the process has used (user + system, /proc/PID/stat), None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[-1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15
    except (OSError, ValueError, IndexError):
        return None


def catches(pid: int) -> bool:
    """Whether the process has a handler for DUMP_SIGNAL (/proc's SigCgt mask), so sending it cannot kill it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(DUMP_SIGNAL) - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def request(pid: int) -> bool:
    """Ask the process for its stacks (only if it catches the signal and is not stopped); True if asked."""
    if state(pid) in (None, "stopped", "stopped by a tracer", "exited") or not catches(pid):
        return False
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        return False
    return True
