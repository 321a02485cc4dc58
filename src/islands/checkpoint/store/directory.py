"""CheckpointStore: versioned, fsynced, checksummed checkpoint directories with a `latest` pointer.

Layout under root:
    latest                         text file naming the newest durable checkpoint directory
    step-000120/rank00000.data     concatenated codec blobs (each with per-chunk XXH3-64 checksums)
    step-000120/rank00000.manifest.json
    step-000140.tmp-1a2b3c4d/      a save in progress or interrupted: ignored, removed at next open

Save protocol (each step fsynced before the next depends on it): write files into a fresh
`step-N.tmp-<token>` directory, fsync each file and the directory, barrier across ranks, rank 0 renames
it to `step-N`, fsyncs root, then atomically replaces `latest`. A crash at any point leaves the previous
checkpoint loadable (issue #6). Unchanged tensors are not written again: the manifest references the
older file by content hash (exact dedup, as Git-Theta does per parameter group, LIT-762), and retention
never deletes a directory a kept checkpoint still reads from. Optional XOR deltas against a full base
checkpoint at most `delta_every` saves back (SOTA-437).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

from islands.checkpoint.codec.tensor import TensorCodec, content_hash, decode_tensor, encode_tensor
from islands.checkpoint.errors import CorruptCheckpoint, NoCheckpoint
from islands.checkpoint.store import fsio
from islands.checkpoint.store.manifest import (
    blob_checksum,
    blob_intact,
    data_name,
    encode_manifest,
    manifest_name,
    raise_if_mismatch,
    read_manifest,
    referenced_dirs,
)
from islands.checkpoint.store.replicas import ReplicaShare, take_entries
from islands.checkpoint.store.tree import flatten_tree, unflatten_tree

_STEP_DIR = re.compile(r"^step-(\d+)$")
LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


@dataclass
class SaveResult:
    step: int
    path: Path
    bytes_written: int = 0
    bytes_deduped: int = 0  # raw tensor bytes not written because an older file holds them
    bytes_shared: int = 0  # raw tensor bytes not written because rank 0's part of this step holds them
    raw_bytes: int = 0
    tensors_written: int = 0
    tensors_deduped: int = 0
    tensors_shared: int = 0
    seconds: float = 0.0


@dataclass
class LoadedCheckpoint:
    step: int
    tree: object
    path: Path
    manifest: dict
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (dir, why) newer ones that failed


class CheckpointStore:
    """One directory of checkpoints. Each rank builds its own store object on the same root.

    keep_last: how many newest checkpoints retention keeps (plus whatever they reference).
    codec: how tensors are encoded. delta_every: 0 = no deltas; K = every K-th save is a full base and
    the others are XOR deltas against it. barrier: a callable all ranks enter (required if world_size > 1).
    fault_hook: called with each write phase's name before it runs (crash tests).
    share_replicas: ranks > 0 do not write a tensor whose bytes rank 0's part of the same step holds
    (data-parallel replicas: DDP's model and optimizer, FSDP's gathered full state); their manifests
    point at rank 0's file (replicas.py). Two more barriers per save; every rank still encodes at once.
    Rank 0 (or `clean=True`) removes partial saves of earlier runs here, so every rank must build its
    store before any rank saves (in training, the first collective step orders them).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep_last: int = 3,
        codec: TensorCodec | None = None,
        delta_every: int = 0,
        rank: int = 0,
        world_size: int = 1,
        barrier: Callable[[], None] | None = None,
        fault_hook: fsio.FaultHook | None = None,
        clean: bool | None = None,
        share_replicas: bool = False,
    ):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (the newest checkpoint is never deleted), got {keep_last}")
        if delta_every < 0:
            raise ValueError(f"delta_every must be >= 0 (0 disables deltas), got {delta_every}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if world_size > 1 and barrier is None:
            raise ValueError("world_size > 1 needs a barrier callable so rank 0 commits only after all ranks wrote")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep_last, self.codec, self.delta_every = keep_last, codec or TensorCodec(), delta_every
        self.rank, self.world_size, self.barrier, self.fault_hook = rank, world_size, barrier, fault_hook
        self.share_replicas = share_replicas and world_size > 1
        self.cleaned = fsio.clean_partials(self.root) if (rank == 0 if clean is None else clean) else []
        self._previous: dict | None = None  # this rank's last manifest body: the dedup reference
        self._base: dict | None = None  # last full base manifest body (delta mode)
        self._base_cache: dict[str, torch.Tensor] = {}
        self._since_base = 0

    # ---- listing -------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps of committed checkpoint directories, ascending (intact or not: see verify)."""
        found = []
        for entry in self.root.iterdir():
            m = _STEP_DIR.match(entry.name)
            if m and entry.is_dir():
                found.append(int(m.group(1)))
        return sorted(found)

    def steps_by_preference(self) -> list[int]:
        """Committed steps in the order a load without a step tries them: `latest`, the older steps
        newest first, then any step past `latest`. The pointer moves at every commit, so a step past it
        was left by a run that resumed from an older step: a timeline that run abandoned."""
        order = sorted(self.steps(), reverse=True)
        latest = self.latest_step()
        if latest not in order:
            return order
        return [latest] + [s for s in order if s < latest] + [s for s in order if s > latest]

    def latest_step(self) -> int | None:
        """The step `latest` points to, or None if there is no (readable) pointer."""
        try:
            m = _STEP_DIR.match((self.root / LATEST).read_text().strip())
        except (FileNotFoundError, UnicodeDecodeError):
            return None
        return int(m.group(1)) if m else None

    def path_for(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    # ---- save ----------------------------------------------------------------------------------
    def save(self, tree, step: int, *, fingerprint: str | None = None, token: str | None = None) -> SaveResult:
        """Write `tree` as checkpoint `step` durably; returns once `latest` points at it (on rank 0).

        token: the staging-directory suffix all ranks agree on (default: random when world_size == 1,
        f"w{world_size}" otherwise). The tree is only read.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        start = time.perf_counter()
        if fingerprint is None and isinstance(tree, dict) and isinstance(tree.get("config_fingerprint"), str):
            fingerprint = tree["config_fingerprint"]
        name = step_dir_name(step)
        token = token or (fsio.nonce() if self.world_size == 1 else f"w{self.world_size}")
        staging = self.root / f"{name}{fsio.TMP_MARK}{token}"
        self._phase("staging_mkdir")
        staging.mkdir(exist_ok=self.world_size > 1)
        skeleton, tensors = flatten_tree(tree)
        previous = self._previous if self._previous is not None else self._latest_own_manifest()
        if previous is not None and previous.get("step", -1) >= step:
            # a checkpoint of this step or a later one is from a timeline this run left (it resumed from
            # an older step): its directory is replaced when this run reaches that step, so nothing
            # written now may point into it (that left re-saved steps pointing at deleted data)
            previous = None
        is_base = self.delta_every > 0 and (self._base is None or self._since_base >= self.delta_every)
        if is_base:
            self._base_cache.clear()

        def usable(body: dict | None) -> dict[str, dict]:  # a manifest's entries this save may point at
            return {
                e["content_hash"]: e
                for e in (body or {}).get("tensors", {}).values()
                if not (is_base and e.get("delta_base"))
            }

        by_hash = usable(previous)
        share = None
        if self.share_replicas:
            assert self.barrier is not None  # share_replicas needs world_size > 1, which needs a barrier
            share = ReplicaShare(staging, self.rank, self.barrier, self._phase)
        digests = {tname: content_hash(t) for tname, t in tensors.items()} if share else {}
        rank0_holds = share.rank0_hashes(digests) if share else set()
        deferred: dict[str, str] = {}  # name -> hash of the tensors rank 0 writes for this rank
        result = SaveResult(step=step, path=self.path_for(step))
        entries: dict[str, dict] = {}
        data_rel = f"{name}/{data_name(self.rank)}"

        def encoded_blobs():  # a generator: one encoded tensor in memory at a time, not the whole checkpoint
            offset = 0
            for tname, tensor in tensors.items():
                digest = digests[tname] if share else content_hash(tensor)
                nbytes = tensor.numel() * tensor.element_size()
                result.raw_bytes += nbytes
                if digest in by_hash:
                    entries[tname] = dict(by_hash[digest])
                    result.tensors_deduped += 1
                    result.bytes_deduped += nbytes
                    continue
                if digest in rank0_holds:  # a replica: rank 0's entry goes in once its manifest exists
                    deferred[tname] = digest
                    result.tensors_shared += 1
                    result.bytes_shared += nbytes
                    continue
                base_entry, base_tensor = self._delta_base_for(tname, tensor, is_base)
                # the hash lives in the manifest entry (dedup reads it there; loads check against it): not
                # again in the blob, where it was ~32 bytes of every tensor's blob
                blob = encode_tensor(tensor, base=base_tensor, codec=self.codec, content_hash=False)
                entries[tname] = {
                    "dtype": str(tensor.dtype).removeprefix("torch."),
                    "shape": list(tensor.shape),
                    "codec": self.codec.layout,
                    "file": data_rel,
                    "offset": offset,
                    "length": len(blob),
                    **blob_checksum(blob),
                    "content_hash": digest,
                    "delta_base": base_entry,
                }
                offset += len(blob)
                result.tensors_written += 1
                yield blob

        self._phase("data_write")
        for stale in (staging / data_name(self.rank), staging / manifest_name(self.rank)):
            stale.unlink(missing_ok=True)  # a retried multi-rank save reuses the staging directory
        result.bytes_written = fsio.write_durable(staging / data_name(self.rank), encoded_blobs())
        body = {
            "step": step,
            "rank": self.rank,
            "world_size": self.world_size,
            "created": time.time(),
            "config_fingerprint": fingerprint,
            "skeleton": skeleton,
            "tensors": entries,
        }

        def write_manifest() -> None:
            self._phase("manifest_write")
            result.bytes_written += fsio.write_durable(staging / manifest_name(self.rank), [encode_manifest(body)])

        if share is None or self.rank == 0:
            write_manifest()
        if share is not None:
            from_rank0 = share.rank0_entries(usable)  # after rank 0's manifest is written
            if self.rank > 0:
                entries.update(take_entries(deferred, from_rank0))
                body["tensors"] = {tname: entries[tname] for tname in tensors}  # the tree's order
                write_manifest()
        self._phase("staging_fsync")
        fsio.fsync_dir(staging)
        if self.barrier is not None:
            self.barrier()
        if self.rank == 0:
            self._commit(staging, step)
        if self.barrier is not None:
            try:
                self.barrier()  # no rank reports success before the pointer moved
            except Exception:
                # Rank 0 left before saying it committed (an elastic member killed right after its
                # commit): the checkpoint counts if it was committed, which is the rename of the
                # staging directory; rank 0 may have died before it also moved `latest`.
                if self.rank == 0 or not self._renamed(staging, step):
                    raise
        self._previous = body
        if is_base:
            self._base, self._since_base = body, 1
        elif self.delta_every > 0:
            self._since_base += 1
        result.seconds = time.perf_counter() - start
        return result

    def _renamed(self, staging: Path, step: int) -> bool:
        """Whether rank 0 committed `step` from `staging`: the staging directory became the step's."""
        return not staging.exists() and (self.path_for(step) / manifest_name(self.rank)).exists()

    def _commit(self, staging: Path, step: int) -> None:
        missing = [r for r in range(self.world_size) if not (staging / manifest_name(r)).exists()]
        if missing:
            raise CorruptCheckpoint(f"ranks {missing} did not write their part of step {step}; not committing")
        final = self.path_for(step)
        self._phase("commit_rename")
        if final.exists():  # re-saving a step (resumed from an older one): the new save wins
            fsio.remove_tree_atomic(final)
        os.replace(staging, final)
        self._phase("root_fsync")
        fsio.fsync_dir(self.root)
        fsio.replace_file_atomic(self.root / LATEST, f"{final.name}\n".encode(), self.fault_hook, "latest")
        self._phase("retention")
        self.apply_retention()

    def _delta_base_for(self, tname: str, tensor: torch.Tensor, is_base: bool):
        if self.delta_every == 0 or is_base or self._base is None:
            return None, None
        entry = self._base["tensors"].get(tname)
        if (
            entry is None
            or entry.get("delta_base")
            or entry["shape"] != list(tensor.shape)
            or entry["dtype"] != str(tensor.dtype).removeprefix("torch.")
        ):
            return None, None
        if tname not in self._base_cache:
            files: dict[str, BinaryIO] = {}
            try:
                self._base_cache[tname] = self._read_tensor(entry, files)
            finally:
                for f in files.values():
                    f.close()
        location = {k: entry[k] for k in ("file", "offset", "length", "xxh3", "checksum", "content_hash") if k in entry}
        return location, self._base_cache[tname]

    def apply_retention(self) -> list[int]:
        """Delete checkpoints beyond keep_last unless a kept one references them. Returns deleted steps.

        The keep_last newest are counted up to `latest`: steps past it (left by a run that resumed from
        an older step, see steps_by_preference) neither take those places nor are deleted here; once
        this run's latest passes them they count like its own."""
        steps = self.steps()
        latest = self.latest_step()
        own = [s for s in steps if latest is None or s <= latest]
        keep = set(own[-self.keep_last :]) | {s for s in steps if latest is not None and s > latest}
        if latest is not None:
            keep.add(latest)
        needed = set()
        for step in keep:
            try:
                for body in self._manifests(step):
                    needed |= referenced_dirs(body)
            except CorruptCheckpoint:
                return []  # cannot tell what a damaged kept checkpoint references: delete nothing
        deleted = []
        for step in steps:
            if step not in keep and step_dir_name(step) not in needed:
                fsio.remove_tree_atomic(self.path_for(step))
                deleted.append(step)
        return deleted

    # ---- load ----------------------------------------------------------------------------------
    def load(
        self,
        step: int | None = None,
        *,
        like=None,
        fingerprint: str | None = None,
        rank: int | None = None,
        verify: bool = True,
    ) -> LoadedCheckpoint:
        """Load this rank's (or `rank`'s) part of checkpoint `step`; None = newest intact one.

        Every blob's chunk checksums (XXH3-64) are checked before decoding and (verify=True) each tensor's SHA-256
        after.
        With step=None a damaged checkpoint is skipped in favour of the next older one (reported in
        `.skipped`; steps newer than `latest`, left by a run that resumed from an older step, come
        last); an explicit step raises CorruptCheckpoint. `like` (a state tree of the current model)
        and `fingerprint` raise CheckpointMismatch naming every difference.
        """
        rank = self.rank if rank is None else rank
        if step is not None:
            return self._load_one(step, like, fingerprint, rank, verify)
        order = self.steps_by_preference()
        skipped = []
        for candidate in order:
            try:
                loaded = self._load_one(candidate, like, fingerprint, rank, verify)
            except CorruptCheckpoint as exc:
                skipped.append((step_dir_name(candidate), str(exc)))
                continue
            loaded.skipped = skipped
            return loaded
        detail = "; ".join(f"{d}: {why}" for d, why in skipped) or "no checkpoint directories"
        raise NoCheckpoint(f"no intact checkpoint under {self.root} ({detail})")

    def _load_one(self, step, like, fingerprint, rank, verify) -> LoadedCheckpoint:
        path = self.path_for(step)
        if not path.is_dir():
            raise NoCheckpoint(f"no checkpoint for step {step} under {self.root}")
        body = read_manifest(path / manifest_name(rank))
        raise_if_mismatch(body, like, fingerprint)
        files: dict[str, BinaryIO] = {}
        try:
            tensors = {name: self._read_tensor(entry, files, verify) for name, entry in body["tensors"].items()}
        finally:
            for f in files.values():
                f.close()
        if self.rank == rank:
            self._previous = body
        return LoadedCheckpoint(step=step, tree=unflatten_tree(body["skeleton"], tensors), path=path, manifest=body)

    def _read_tensor(self, entry: dict, files: dict, verify: bool = True) -> torch.Tensor:
        blob = self._read_blob(entry, files)
        base = None
        if entry.get("delta_base"):
            base_entry = entry["delta_base"]
            base = decode_tensor(
                self._read_blob(base_entry, files), verify=verify, expect_hash=base_entry.get("content_hash")
            )
        return decode_tensor(blob, base=base, verify=verify, expect_hash=entry["content_hash"])

    def _read_blob(self, entry: dict, files: dict[str, BinaryIO]) -> bytes:
        rel = entry["file"]
        try:
            f = files.get(rel)
            if f is None:  # one handle per data file for the whole load; the caller owning `files` closes them
                f = files[rel] = open(self.root / rel, "rb")  # noqa: SIM115
        except FileNotFoundError as exc:
            raise CorruptCheckpoint(f"data file {rel} referenced by the manifest is missing") from exc
        f.seek(entry["offset"])
        blob = f.read(entry["length"])
        if not blob_intact(entry, blob):
            raise CorruptCheckpoint(f"checksum mismatch in {rel} at offset {entry['offset']}: data is damaged")
        return blob

    def verify(self, step: int) -> list[str]:
        """Fully decode and check every rank's part of `step`. Returns problems (empty = intact)."""
        problems = []
        for r in range(self._world_size_of(step)):
            try:
                self._load_one(step, None, None, r, True)
            except (CorruptCheckpoint, NoCheckpoint) as exc:
                problems.append(f"rank {r}: {exc}")
        return problems

    # ---- helpers -------------------------------------------------------------------------------
    def _world_size_of(self, step: int) -> int:
        try:
            return int(read_manifest(self.path_for(step) / manifest_name(0))["world_size"])
        except CorruptCheckpoint:
            return 1

    def _manifests(self, step: int) -> list[dict]:
        path = self.path_for(step)
        return [read_manifest(p) for p in sorted(path.glob("rank*.manifest.json"))]

    def _latest_own_manifest(self) -> dict | None:
        latest = self.latest_step()
        if latest is None:
            return None
        try:
            return read_manifest(self.path_for(latest) / manifest_name(self.rank))
        except CorruptCheckpoint:
            return None

    def _phase(self, name: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(name)
