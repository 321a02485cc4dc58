"""Whether a silent process is hung or only waiting for a CPU, and which local process a worker is.

A worker whose heartbeat stops for the heartbeat timeout is taken for stopped, cut off or hung. On a loaded
machine (more runnable processes than cores, a VM's stolen vCPU) a live worker can go that long without a
CPU: its process is runnable (state R) and used next to no CPU during its silence. Killing it is a false death
(session 20's chaos runs: the launcher's reaper spared 16 such workers while the island leaders' FollowerWatch
convicted 10). Both watchers ask `Starvation` instead: a silent process that got less than `share` of its
silence in CPU time is spared, up to `limit` heartbeat timeouts; a stopped, sleeping or CPU-burning one is not.

A process is named across processes by `identity()`: the machine's boot id, its pid and its start time (in
clock ticks since boot). A reader finds the same process with `local_pid(identity)` only on the same machine
and only while that very process runs (a reused pid has another start time; another pid namespace on the same
kernel would show another start time or no such pid). Workers publish theirs under `proc/<name>` in the job's
store when their heartbeat starts (islands.runtime.elastic.membership.Heartbeat).
"""

from __future__ import annotations

import os

from islands.runtime import stacks

PROC_KEY = "proc/{}"  # the store key of a worker's process identity
# A silent process that used less CPU than SHARE of its silence was waiting for one (measured in session 20's
# chaos runs: starved workers got 10-20% of a CPU while ~12 busy processes shared 2 cores; a hung one in a C
# call holding the GIL burns ~100%). It is spared up to LIMIT heartbeat timeouts of silence.
SHARE, LIMIT = 0.25, 3.0


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[-1].split()[19])  # field 22, starttime
    except (OSError, ValueError, IndexError):
        return None


def identity(pid: int | None = None) -> str | None:
    """ "BOOT_ID:PID:START" for `pid` (this process by default), None where /proc cannot tell (not Linux)."""
    pid = os.getpid() if pid is None else pid
    boot, start = _boot_id(), _start_ticks(pid)
    return None if boot is None or start is None else f"{boot}:{pid}:{start}"


def local_pid(ident: str | bytes | None) -> int | None:
    """The pid of the process `ident` names if it runs on this machine (same boot id and start time), else None."""
    if isinstance(ident, bytes):
        ident = ident.decode(errors="replace")
    if ident is None:
        return None
    try:
        boot, pid_text, start_text = ident.split(":")
        pid, start = int(pid_text), int(start_text)
    except (AttributeError, ValueError):
        return None
    return pid if boot == _boot_id() and _start_ticks(pid) == start else None


class Starvation:
    """CPU samples of watched processes, one per `sample` call, and the verdict for a silent one.

    `timeout_s`: the heartbeat timeout (the spare ends at `limit` of them). Samples older than the longest silence
    that can still be spared are dropped, two kept at least."""

    def __init__(self, timeout_s: float, share: float = SHARE, limit: float = LIMIT):
        self.timeout, self.share, self.limit = timeout_s, share, limit
        self._samples: dict[str, list[tuple[float, float]]] = {}  # name -> (when, CPU seconds)
        self.spared: set[str] = set()  # names ever spared (their watcher says so the first time only)

    def sample(self, name: str, pid: int, now: float) -> None:
        cpu = stacks.cpu_seconds(pid)
        if cpu is None:
            return
        samples = self._samples.setdefault(name, [])
        samples.append((now, cpu))
        keep = now - self.limit * self.timeout - 1.0
        while len(samples) > 2 and samples[1][0] < keep:
            samples.pop(0)

    def forget(self, name: str) -> None:
        self._samples.pop(name, None)

    def waits_for_cpu(self, name: str, pid: int, silent_for: float, now: float) -> tuple[float, float, bool] | None:
        """(CPU seconds used, wall seconds, first time) since `name`'s silence began when its process is runnable,
        used less than `share` of that time, and the silence is still under `limit` timeouts; None otherwise (it
        counts as silent). `first time`: this is the first spare of `name` (said once by its watcher)."""
        samples = self._samples.get(name, [])
        if silent_for >= self.limit * self.timeout or len(samples) < 2 or stacks.state(pid) != "running":
            return None
        start = now - silent_for
        then = next((s for s in samples if s[0] >= start), samples[0])
        wall, used = samples[-1][0] - then[0], samples[-1][1] - then[1]
        if wall <= 0 or used >= self.share * wall:
            return None
        first = name not in self.spared
        self.spared.add(name)
        return used, wall, first
