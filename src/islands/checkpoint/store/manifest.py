"""Per-rank manifest: the JSON description of one rank's part of a checkpoint, checksummed itself.

Body: step, rank, world size, config fingerprint, the state tree's JSON skeleton, and per tensor its
dtype, shape, codec layout, location (file relative to the store root, offset, length), the stored
blob's XXH3-64 (`xxh3`; manifests before session 9 hold a CRC-32 under `checksum`, still checked) and
SHA-256 content hash (dedup key and end-to-end check). The file wraps the body with a
CRC-32 of its canonical JSON, so a damaged manifest is detected rather than misread.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import xxhash

from islands.checkpoint.errors import CheckpointMismatch, CorruptCheckpoint
from islands.checkpoint.store.tree import flatten_tree

FORMAT = "islands-checkpoint/1"


def manifest_name(rank: int) -> str:
    return f"rank{rank:05d}.manifest.json"


def data_name(rank: int) -> str:
    return f"rank{rank:05d}.data"


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def blob_checksum(blob) -> dict:
    """The checksum fields of a tensor blob's manifest entry: XXH3-64, ~30 GB/s here against CRC-32's 2.7
    (a CRC-32 until session 9; with it and codec format 7, ckpt-stall's synchronous saves took 15-29%
    less time)."""
    return {"xxh3": xxhash.xxh3_64_intdigest(blob)}


def blob_intact(entry: dict, blob) -> bool:
    """Whether `blob` has the length and checksum its manifest entry recorded (XXH3, or an old CRC-32)."""
    if len(blob) != entry["length"]:
        return False
    if "xxh3" in entry:
        return xxhash.xxh3_64_intdigest(blob) == entry["xxh3"]
    return zlib.crc32(blob) == entry["checksum"]


def encode_manifest(body: dict) -> bytes:
    wrapped = {"format": FORMAT, "crc32": zlib.crc32(_canonical(body)), "body": body}
    return json.dumps(wrapped, indent=1).encode()  # file order kept: dict order is part of the tree


def decode_manifest(data: bytes, where: str = "manifest") -> dict:
    try:
        wrapped = json.loads(data)
    except ValueError as exc:
        raise CorruptCheckpoint(f"{where} is not valid JSON ({exc}): the file is damaged or truncated") from exc
    if not isinstance(wrapped, dict) or wrapped.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{where} is not an {FORMAT} manifest")
    body = wrapped.get("body")
    if not isinstance(body, dict) or zlib.crc32(_canonical(body)) != wrapped.get("crc32"):
        raise CorruptCheckpoint(f"{where} checksum mismatch: the manifest was altered or damaged")
    return body


def read_manifest(path: Path) -> dict:
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise CorruptCheckpoint(f"missing manifest {path}") from exc
    return decode_manifest(data, str(path))


def referenced_dirs(body: dict) -> set[str]:
    """Checkpoint directories whose files this manifest reads (itself, dedup sources, delta bases)."""
    dirs = set()
    for entry in body["tensors"].values():
        dirs.add(entry["file"].split("/", 1)[0])
        if entry.get("delta_base"):
            dirs.add(entry["delta_base"]["file"].split("/", 1)[0])
    return dirs


def compare_with(body: dict, like=None, fingerprint: str | None = None) -> list[str]:
    """Differences between a stored manifest and the caller's state tree / config fingerprint."""
    diffs = []
    stored_fp = body.get("config_fingerprint")
    if fingerprint is not None and stored_fp != fingerprint:
        diffs.append(f"config fingerprint differs: checkpoint {stored_fp!r}, current {fingerprint!r}")
    if like is not None:
        _, tensors = flatten_tree(like)
        stored = body["tensors"]
        for name in sorted(set(tensors) - set(stored)):
            diffs.append(f"missing key {name!r} (in the current model, not in the checkpoint)")
        for name in sorted(set(stored) - set(tensors)):
            diffs.append(f"unexpected key {name!r} (in the checkpoint, not in the current model)")
        for name in sorted(set(stored) & set(tensors)):
            want, got = tensors[name], stored[name]
            if list(want.shape) != got["shape"]:
                diffs.append(
                    f"shape mismatch for {name!r}: checkpoint {tuple(got['shape'])}, current {tuple(want.shape)}"
                )
            elif str(want.dtype).removeprefix("torch.") != got["dtype"]:
                diffs.append(f"dtype mismatch for {name!r}: checkpoint {got['dtype']}, current {want.dtype}")
    return diffs


def raise_if_mismatch(body: dict, like=None, fingerprint: str | None = None) -> None:
    diffs = compare_with(body, like, fingerprint)
    if diffs:
        raise CheckpointMismatch(diffs)
