"""Where testbeds are remembered between processes: one JSON file per testbed, written atomically.

The directory lives under /run (a tmpfs) because namespaces do not survive a reboot either; a
stale file after a reboot is harmless since `status` checks what really exists.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

DEFAULT_STATE_DIR = "/run/islands/testbeds"
STATE_DIR_ENV = "ISLANDS_TESTBED_DIR"


def state_dir() -> Path:
    return Path(os.environ.get(STATE_DIR_ENV, DEFAULT_STATE_DIR))


def state_path(name: str) -> Path:
    return state_dir() / f"{name}.json"


def save(name: str, data: dict) -> Path:
    path = state_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{name}.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    return path


def load(name: str) -> dict | None:
    try:
        return json.loads(state_path(name).read_text())
    except FileNotFoundError:
        return None


def remove(name: str) -> bool:
    try:
        state_path(name).unlink()
        return True
    except FileNotFoundError:
        return False


def saved_names() -> list[str]:
    directory = state_dir()
    if not directory.is_dir():
        return []
    return sorted(p.stem for p in directory.glob("*.json") if not p.name.startswith("."))


@contextlib.contextmanager
def locked():
    """Serialise up/down across processes (two `up`s of one name would fight). One lock file for
    all testbeds: `up` takes seconds at most, and a per-name file could never be deleted safely."""
    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
