"""Open a connection from inside a named network namespace, for the calling thread only.

An elastic job on a testbed keeps its store on the testbed's hub (islands.testbed: the hub namespace holds
the bridge every host's link ends on), which the launcher, in the machine's own namespace, cannot reach by
address. Linux keeps a network namespace per thread, and a socket stays in the namespace it was created
in: so the launcher enters the hub for the moment it opens a socket (setns(2) on this thread) and comes
back, and that socket then talks to the hub for the rest of its life while every other thread of the
process never left the machine's namespace. Named namespaces are the files `ip netns add` makes under
/var/run/netns.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

CLONE_NEWNET = 0x40000000  # <sched.h>
NETNS_DIR = "/var/run/netns"

_libc = None


def setns(fd: int) -> None:
    """Move the calling thread into the network namespace open at `fd`."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns(CLONE_NEWNET) failed: {os.strerror(errno)}")


@contextlib.contextmanager
def entered(name: str | None):
    """Inside the block this thread's sockets are created in network namespace `name` (None or "": no
    change). The thread is back in its own namespace after the block, whatever happened in it."""
    if not name:
        yield
        return
    target = _open(name)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(target)
        try:
            yield
        finally:
            setns(own)  # never leave a thread of the caller in the testbed
    finally:
        os.close(target)
        os.close(own)


def enter(name: str) -> None:
    """Move the calling thread into namespace `name` for good (a freshly forked, single-threaded process: all of
    it, and every thread it starts later)."""
    fd = _open(name)
    try:
        setns(fd)
    finally:
        os.close(fd)


def _open(name: str) -> int:
    path = os.path.join(NETNS_DIR, name)
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise OSError(f"network namespace {name!r} does not exist ({path} is missing)") from None


def current() -> str:
    """This thread's namespace as the kernel names it ('net:[4026531840]'): for checks and records."""
    return os.readlink("/proc/thread-self/ns/net")
