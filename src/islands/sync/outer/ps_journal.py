"""A parameter server shard that survives its process (issue #36, part 2): the last committed state plus a durable
log of every change since, so a server killed at any instant is rebuilt with every contribution it acknowledged.

The scheme (chosen over a hot backup replica: one writer, no second copy of the model to keep in step, and the same
files are the shard's checkpoint):

    push:    append {island, nonce, seq, version, samples, delta, active[, buffers]} to log.<n>, fsync, apply,
             answer
    settle:  an island left or lapsed and the window stepped: append {active}, fsync
    commit:  every `commit_every` records: write snapshot.pt (the whole state, naming segment n + 1) to a temporary
             file, fsync, rename over the old one, then start log.<n + 1> and delete log.<n>
    rebuild: load snapshot.pt, replay its segment's records in order through the same ServerState methods

A push is logged before it is applied and answered, so an acknowledged push is always in the log; a record torn by a
kill mid-write fails its length or CRC and ends the replay (it was never answered: the island sends it again). Each
island numbers its pushes (seq, under a random nonce per island process): a push whose number the shard has already
applied (sent again after the answer was lost with the server) is answered with the current model and applied only
once. ServerState is deterministic, so the rebuilt shard equals the killed one bit for bit (tested).

Buffers (ps_buffers.py; process mode's shard 0 of a model that has them): the island's buffer vector is a field of
its push's record, so one fsync makes both durable and a kill cannot keep one without the other; the table is in
every commit and in state_dict (SNAPSHOT / RESTORE). A shard without a table writes the records and snapshots it
wrote before (no `buffers` key), and a journal or checkpoint without them loads as an empty table.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from islands.sync.outer.ps_buffers import BufferTable
from islands.sync.outer.ps_server import Ack, Contribution, ServerState

_HEAD = struct.Struct("<QI")  # record length, CRC32 of the record
COMMIT_EVERY = 64  # records per log segment: bounds the replay at a restart and the log's size on disk


def _to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    """snapshot.pt and log.<n> in one directory (module docstring). One writer at a time: the supervisor starts a
    shard's next process only after the previous one is dead."""

    def __init__(self, path: str | os.PathLike, commit_every: int = COMMIT_EVERY):
        if isinstance(commit_every, bool) or not isinstance(commit_every, int) or commit_every < 1:
            raise ValueError(f"commit_every must be an int >= 1 (records per log segment), got {commit_every!r}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.commit_every = commit_every
        self.segment = 0
        self.records = 0  # in the open segment
        self.file: io.BufferedWriter | None = None

    @property
    def snapshot_path(self) -> Path:
        return self.path / "snapshot.pt"

    def log_path(self, segment: int) -> Path:
        return self.path / f"log.{segment}"

    def recover(self) -> tuple[dict | None, list[dict]]:
        """(the committed state or None, the records logged since, in order); cuts a torn tail off the log and
        opens it for appending."""
        state = None
        if self.snapshot_path.exists():
            saved = _from_bytes(self.snapshot_path.read_bytes())
            state, self.segment = saved["state"], int(saved["segment"])
        records, good = [], 0
        log = self.log_path(self.segment)
        data = log.read_bytes() if log.exists() else b""
        while good + _HEAD.size <= len(data):
            length, crc = _HEAD.unpack_from(data, good)
            body = data[good + _HEAD.size : good + _HEAD.size + length]
            if len(body) != length or zlib.crc32(body) != crc:
                break  # torn by a kill mid-write: never answered
            records.append(_from_bytes(body))
            good += _HEAD.size + length
        if good != len(data):
            with open(log, "r+b") as f:
                f.truncate(good)
        self.records = len(records)
        self.file = open(log, "ab")  # noqa: SIM115 - held open for appends until close()
        return state, records

    def append(self, record: dict) -> None:
        assert self.file is not None, "recover() opens the journal"
        body = _to_bytes(record)
        self.file.write(_HEAD.pack(len(body), zlib.crc32(body)) + body)
        self.file.flush()
        os.fsync(self.file.fileno())
        self.records += 1

    def due(self) -> bool:
        return self.records >= self.commit_every

    def commit(self, state: dict) -> None:
        """Make `state` the committed one and start an empty segment (module docstring: a kill at any point of
        this leaves either the old snapshot with its whole log or the new one)."""
        tmp = self.path / "snapshot.pt.tmp"
        with open(tmp, "wb") as f:
            f.write(_to_bytes({"state": state, "segment": self.segment + 1}))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.snapshot_path)
        _fsync_dir(self.path)
        old = self.log_path(self.segment)
        if self.file is not None:
            self.file.close()
        self.segment += 1
        self.records = 0
        self.file = open(self.log_path(self.segment), "ab")  # noqa: SIM115
        old.unlink(missing_ok=True)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


@dataclass(frozen=True)
class Applied:
    """The last push of an island that a shard applied: its nonce and number, and the answer it got."""

    nonce: int
    seq: int
    ack: Ack


class DurableShard:
    """A ServerState whose every change is logged first (module docstring). `journal` None: in memory only (the
    thread mode's server, and the tests' reference). `buffers`: the islands' buffer table (shard 0 of a model with
    buffers), journaled with the pushes that carry it; None elsewhere."""

    def __init__(self, state: ServerState, journal: Journal | None = None, buffers: BufferTable | None = None):
        self.state, self.journal, self.buffers = state, journal, buffers
        self.applied: dict[int, Applied] = {}
        self.restarts = 0  # rebuilds from the journal this shard has been through
        self.duplicates = 0  # pushes this process answered again without applying them (not journaled)

    def open(self) -> int:
        """Rebuild from the journal (if it holds anything): returns the records replayed."""
        if self.journal is None:
            return 0
        saved, records = self.journal.recover()
        if saved is not None:
            self.load_state_dict(saved)
        for r in records:
            self._replay(r)
        if saved is not None or records:
            self.restarts += 1
        return len(records)

    def push(
        self, island: int, nonce: int, seq: int, c: Contribution, active: int, buffers: torch.Tensor | None = None
    ) -> tuple[Ack, bool]:
        """(the ack, True when this push was applied before: answered again, not applied twice). `buffers`: the
        island's buffer vector the push carried, kept in the table (a refused push's too, as thread mode's loop
        does) in the same record as the push; a duplicate's is the one already kept (the same request resent)."""
        last = self.applied.get(island)
        if last is not None and last.nonce == nonce and seq <= last.seq:
            self.duplicates += 1
            return Ack(last.ack.accepted, self.state.version, last.ack.staleness, False), True
        record = {
            "k": "push",
            "island": island,
            "nonce": nonce,
            "seq": seq,
            "version": c.version,
            "samples": c.samples,
            "delta": c.delta.to(torch.float32),
            "active": active,
        }
        # checked before anything is logged; absent without a table, so such a record is the one written before
        kept = None if self.buffers is None or buffers is None else self.buffers.kept(island, buffers)
        if kept is not None:
            record["buffers"] = kept
        self._log(record)
        ack = self.state.push(c, active)
        self.applied[island] = Applied(nonce, seq, ack)
        if self.buffers is not None and kept is not None:
            self.buffers.put(island, kept)
        self._maybe_commit()
        return ack, False

    def settle(self, active: int) -> bool:
        """The window steps if the islands still training are all in it (an island left or lapsed); logged."""
        if not self.state.ready(active):
            return False
        self._log({"k": "settle", "active": active})
        stepped = self.state.settle(active)
        self._maybe_commit()
        return stepped

    def restore(self, state: dict) -> None:
        """Replace the whole state (a job resumed from its checkpoint), committed at once."""
        self.load_state_dict(state)
        if self.journal is not None:
            self.journal.commit(self.state_dict())

    def _log(self, record: dict) -> None:
        if self.journal is not None:
            self.journal.append(record)

    def _maybe_commit(self) -> None:
        if self.journal is not None and self.journal.due():
            self.journal.commit(self.state_dict())

    def _replay(self, r: dict) -> None:
        if r["k"] == "settle":
            self.state.settle(int(r["active"]))
            return
        c = Contribution(int(r["island"]), int(r["version"]), r["delta"], float(r["samples"]))
        ack = self.state.push(c, int(r["active"]))
        self.applied[c.island] = Applied(int(r["nonce"]), int(r["seq"]), ack)
        if self.buffers is not None and "buffers" in r:  # a record written before buffers were journaled: none
            self.buffers.put(c.island, r["buffers"])

    def state_dict(self) -> dict:
        return {
            "server": self.state.state_dict(),
            "applied": {
                i: [a.nonce, a.seq, a.ack.accepted, a.ack.version, a.ack.staleness, a.ack.stepped]
                for i, a in self.applied.items()
            },
            **({"buffers": self.buffers.state_dict()} if self.buffers is not None else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        if self.buffers is None and "buffers" in state:
            raise ValueError("parameter server state holds buffers, this server none: another model")
        self.state.load_state_dict(state["server"])
        self.applied = {
            int(i): Applied(int(a[0]), int(a[1]), Ack(bool(a[2]), int(a[3]), int(a[4]), bool(a[5])))
            for i, a in state.get("applied", {}).items()
        }
        if self.buffers is not None:  # a state saved before buffers were kept in it holds none: an empty table
            if "buffers" in state:
                self.buffers.load_state_dict(state["buffers"])
            else:
                self.buffers.latest = {}

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
