"""Multi-level checkpointing (SOTA-057, LIT-059): memory every step or so, local disk every k, remote every m.

Each level has its own interval. Memory is fastest to write and to restore but dies with the process
(unless replicated to a peer through a callable the integrator supplies); local disk survives a process
crash; the "remote" level (a second directory standing for remote storage) survives losing the machine.
`restore` collects every level's candidates, newest step first, and takes the first that verifies,
falling back past damaged ones.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from islands.checkpoint.codec.tensor import TensorCodec
from islands.checkpoint.errors import CheckpointMismatch, CorruptCheckpoint, NoCheckpoint
from islands.checkpoint.store.directory import CheckpointStore
from islands.checkpoint.store.manifest import decode_manifest
from islands.checkpoint.store.packed import pack_tree, unpack_tree


def _check_every(every: int) -> int:
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"a level's `every` must be a positive int (save every N steps), got {every!r}")
    return every


class MemoryLevel:
    """Newest checkpoint kept as one packed, checksummed bytes object in this process.

    replicate(step, data): called after each save to ship the bytes to a peer (integrator supplied).
    fetch(): returns the peer's copy (bytes or None), tried when the local copy is missing or damaged.
    """

    def __init__(
        self,
        every: int = 1,
        *,
        replicate: Callable[[int, bytes], None] | None = None,
        fetch: Callable[[], bytes | None] | None = None,
        codec: TensorCodec | None = None,
        name: str = "memory",
    ):
        self.every, self.name = _check_every(every), name
        self.replicate, self.fetch, self.codec = replicate, fetch, codec or TensorCodec(layout="raw")
        self.data: bytes | None = None
        self.step: int | None = None

    def save(self, tree, step: int, **kwargs) -> int:
        data = pack_tree(tree, step, codec=self.codec, fingerprint=kwargs.get("fingerprint"))
        self.data, self.step = data, step
        if self.replicate is not None:
            self.replicate(step, data)
        return len(data)

    def candidates(self) -> list[tuple[int, Callable]]:
        found: list[tuple[int, Callable]] = []
        if self.data is not None:
            assert self.step is not None  # save() sets both
            found.append((self.step, lambda like, fp, data=self.data: unpack_tree(data, like=like, fingerprint=fp)[1]))
        if self.fetch is not None:
            try:
                remote = self.fetch()
            except Exception:  # noqa: BLE001 - an unreachable peer is one fewer level, not a failed restore
                remote = None
            if remote is not None:
                try:
                    step = _peek_step(remote)
                except CorruptCheckpoint:
                    step = -1
                found.append((step, lambda like, fp, data=remote: unpack_tree(data, like=like, fingerprint=fp)[1]))
        return found


def _peek_step(data: bytes) -> int:
    if len(data) < 8:
        raise CorruptCheckpoint("packed checkpoint truncated")
    (head_len,) = struct.unpack_from("<I", data, 4)
    return int(decode_manifest(bytes(data[8 : 8 + head_len]), "packed manifest")["step"])


class DiskLevel:
    """A CheckpointStore used as a level (local disk, or a second directory standing for remote)."""

    def __init__(self, store: CheckpointStore, every: int, *, name: str = "disk"):
        self.store, self.every, self.name = store, _check_every(every), name

    def save(self, tree, step: int, **kwargs):
        return self.store.save(tree, step, **kwargs)

    def candidates(self) -> list[tuple[int, Callable]]:
        """Steps up to `latest` (those past it belong to a timeline a resumed run left), newest first."""
        latest = self.store.latest_step()
        return [
            (s, lambda like, fp, s=s: self.store.load(s, like=like, fingerprint=fp).tree)
            for s in sorted(self.store.steps(), reverse=True)
            if latest is None or s <= latest
        ]


@dataclass
class Restored:
    step: int
    tree: object
    level: str
    skipped: list[tuple[str, int, str]] = field(default_factory=list)  # (level, step, why)


class MultiLevelCheckpointer:
    """Saves to every level whose interval divides the step; restores from the newest intact level.

    It is a sink (has `save(tree, step)`), so AsyncCheckpointer(MultiLevelCheckpointer(...)) snapshots
    once and persists all due levels in the background.
    """

    def __init__(self, levels: list):
        if not levels:
            raise ValueError("MultiLevelCheckpointer needs at least one level")
        names = [lv.name for lv in levels]
        if len(set(names)) != len(names):
            raise ValueError(f"level names must be unique, got {names}")
        self.levels = list(levels)

    def due(self, step: int) -> list[str]:
        return [lv.name for lv in self.levels if step % lv.every == 0]

    def save(self, tree, step: int, **kwargs) -> dict:
        """Save to each due level, fastest (first listed) first. Returns {level name: result}."""
        return {lv.name: lv.save(tree, step, **kwargs) for lv in self.levels if step % lv.every == 0}

    def restore(self, *, like=None, fingerprint: str | None = None) -> Restored:
        """Newest step across levels that loads and verifies; ties go to the earlier (faster) level."""
        options = []
        for rank, lv in enumerate(self.levels):
            for step, loader in lv.candidates():
                options.append((-step, rank, lv.name, step, loader))
        options.sort(key=lambda o: (o[0], o[1]))
        skipped = []
        for _, _, name, step, loader in options:
            try:
                tree = loader(like, fingerprint)
            except (CorruptCheckpoint, NoCheckpoint) as exc:
                skipped.append((name, step, str(exc)))
                continue
            except CheckpointMismatch:
                raise
            return Restored(step=step, tree=tree, level=name, skipped=skipped)
        raise NoCheckpoint(
            "no level holds an intact checkpoint: "
            + ("; ".join(f"{n}@{s}: {why}" for n, s, why in skipped) or "all levels empty")
        )
