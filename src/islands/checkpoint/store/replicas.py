"""Data-parallel replicas written once: what the ranks of one multi-rank save tell each other.

Under DDP (and FSDP once its state is gathered) every rank holds the same model and optimizer state.
With `CheckpointStore(share_replicas=True)` rank 0 writes such a tensor and the other ranks' manifests
point at rank 0's blob. Two exchanges, through files in the save's staging directory and the store's
barrier, keep every rank encoding at the same time:

1. hashes: rank 0 lists the content hashes of its tensors (`replicas.json`, a transient file); after a
   barrier every other rank reads it and encodes only the tensors rank 0 does not hold, in parallel with
   rank 0's encoding (a rank whose state differs, as an island of a DiLoCo job does, loses no time);
2. entries: rank 0 writes its manifest; after a second barrier the others copy its entries (file,
   offset, length, CRC-32, hash) for the tensors they left to it, then write their own manifests.

The manifests stay self-contained, so loading, verifying and resharding read a shared entry like any
other. Equality is by content hash (dtype, shape and bytes, SHA-256), never assumed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from islands.checkpoint.errors import CorruptCheckpoint
from islands.checkpoint.store.manifest import manifest_name, read_manifest

HASHES = "replicas.json"


class ReplicaShare:
    """One rank's side of the two exchanges of one save (two barrier calls, every rank)."""

    def __init__(self, staging: Path, rank: int, barrier: Callable[[], None], phase: Callable[[str], None]):
        self.staging, self.rank, self.barrier, self.phase = staging, rank, barrier, phase

    def rank0_hashes(self, digests: dict[str, str]) -> set[str]:
        """Exchange 1. Rank 0 publishes `digests` (name -> content hash) and gets an empty set back; the
        others get the hashes rank 0 holds (their tensors with those hashes are rank 0's to write)."""
        path = self.staging / HASHES
        if self.rank == 0:
            path.write_text(json.dumps(sorted(set(digests.values()))))
        self.phase("replica_hashes")
        self.barrier()
        if self.rank == 0:
            return set()
        try:
            return set(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise CorruptCheckpoint(f"rank 0's list of replica hashes in {self.staging} is unreadable: {exc}") from exc

    def rank0_entries(self, usable: Callable[[dict], dict[str, dict]]) -> dict[str, dict]:
        """Exchange 2, after rank 0 wrote its manifest: its entries by content hash (filtered by `usable`)
        for the other ranks; rank 0 gets an empty dict and removes the transient hash list (every rank
        read it before this barrier)."""
        self.phase("replica_entries")
        self.barrier()
        if self.rank == 0:
            (self.staging / HASHES).unlink(missing_ok=True)
            return {}
        return usable(read_manifest(self.staging / manifest_name(0)))


def take_entries(deferred: dict[str, str], entries_by_hash: dict[str, dict]) -> dict[str, dict]:
    """{tensor name: rank 0's entry} for the tensors a rank left to rank 0 ({name: content hash})."""
    missing = sorted(name for name, digest in deferred.items() if digest not in entries_by_hash)
    if missing:
        raise CorruptCheckpoint(
            f"rank 0's part of this save holds no entry for {missing[:3]} although its "
            "hash list named them; not writing a manifest that points at nothing"
        )
    return {name: dict(entries_by_hash[digest]) for name, digest in deferred.items()}
