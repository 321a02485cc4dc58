"""Durable file-system steps: write+fsync, fsync a directory, atomic pointer replace, named fault points.

POSIX only makes a rename durable once the *directory* holding it is fsynced; torch's distributed
checkpoint and torchsnapshot skip that step (see issue #6), which is how a crash leaves a torn checkpoint
that looks valid. Every step here is fsynced before the next one depends on it.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

# A fault hook is called with the name of each write phase before it runs; tests make it raise or
# os._exit() to simulate a crash at exactly that point.
FaultHook = Callable[[str], None]

TMP_MARK = ".tmp-"


def nonce() -> str:
    return secrets.token_hex(4)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, chunks: Iterable[bytes | memoryview]) -> int:
    """Write chunks to a new file at `path` and fsync it. Returns bytes written."""
    written = 0
    with open(path, "xb") as f:
        for chunk in chunks:
            f.write(chunk)
            written += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return written


def replace_file_atomic(path: Path, data: bytes, hook: FaultHook | None = None, phase: str = "pointer") -> None:
    """Replace `path` with `data` so a reader sees either the old or the new content, never a mix."""
    tmp = path.with_name(f"{path.name}{TMP_MARK}{nonce()}")
    _call(hook, f"{phase}_tmp_write")
    write_durable(tmp, [data])
    _call(hook, f"{phase}_rename")
    os.replace(tmp, path)
    _call(hook, f"{phase}_dir_fsync")
    fsync_dir(path.parent)


def remove_tree_atomic(path: Path) -> None:
    """Make a directory vanish in one rename (so readers never see half of it), then delete it."""
    doomed = path.with_name(f"{path.name}{TMP_MARK}del-{nonce()}")
    os.replace(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def clean_partials(root: Path) -> list[str]:
    """Delete leftovers of interrupted writes (anything named *.tmp-*). Returns what was removed."""
    removed = []
    for entry in root.iterdir():
        if TMP_MARK in entry.name:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry.name)
    if removed:
        fsync_dir(root)
    return sorted(removed)


def _call(hook: FaultHook | None, phase: str) -> None:
    if hook is not None:
        hook(phase)
