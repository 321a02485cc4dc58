"""A whole state tree in one checksummed bytes object: for the in-memory level and peer replication.

Layout: b"ISLP" | u32 manifest length | manifest (same checksummed JSON as on disk) | codec blobs.
"""

from __future__ import annotations

import struct

from islands.checkpoint.codec.tensor import TensorCodec, content_hash, decode_tensor, encode_tensor
from islands.checkpoint.errors import CorruptCheckpoint
from islands.checkpoint.store.manifest import (
    blob_checksum,
    blob_intact,
    decode_manifest,
    encode_manifest,
    raise_if_mismatch,
)
from islands.checkpoint.store.tree import flatten_tree, unflatten_tree

_MAGIC = b"ISLP"
_HEAD = struct.Struct("<4sI")


def pack_tree(tree, step: int, *, codec: TensorCodec | None = None, fingerprint: str | None = None) -> bytes:
    codec = codec or TensorCodec(layout="raw")  # memory copies favour speed over size
    skeleton, tensors = flatten_tree(tree)
    entries, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        digest = content_hash(t)
        blob = encode_tensor(t, codec=codec, content_hash=False)  # the manifest entry holds the hash
        entries[name] = {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "codec": codec.layout,
            "file": "<packed>",
            "offset": offset,
            "length": len(blob),
            **blob_checksum(blob),
            "content_hash": digest,
            "delta_base": None,
        }
        blobs.append(blob)
        offset += len(blob)
    if fingerprint is None and isinstance(tree, dict) and isinstance(tree.get("config_fingerprint"), str):
        fingerprint = tree["config_fingerprint"]
    body = {
        "step": step,
        "rank": 0,
        "world_size": 1,
        "config_fingerprint": fingerprint,
        "skeleton": skeleton,
        "tensors": entries,
    }
    head = encode_manifest(body)
    return b"".join([_HEAD.pack(_MAGIC, len(head)), head, *blobs])


def unpack_tree(data: bytes, *, like=None, fingerprint: str | None = None, verify: bool = True) -> tuple[int, object]:
    """Returns (step, tree). Raises CorruptCheckpoint on damage, CheckpointMismatch on a foreign model."""
    view = memoryview(data)
    if len(view) < _HEAD.size or bytes(view[:4]) != _MAGIC:
        raise CorruptCheckpoint("not a packed islands checkpoint (bad magic or truncated)")
    _, head_len = _HEAD.unpack_from(view, 0)
    body = decode_manifest(bytes(view[_HEAD.size : _HEAD.size + head_len]), "packed manifest")
    raise_if_mismatch(body, like, fingerprint)
    base = _HEAD.size + head_len
    tensors = {}
    for name, e in body["tensors"].items():
        blob = view[base + e["offset"] : base + e["offset"] + e["length"]]
        if not blob_intact(e, blob):
            raise CorruptCheckpoint(f"packed checkpoint: checksum mismatch for {name!r}")
        tensors[name] = decode_tensor(blob, verify=verify, expect_hash=e["content_hash"])
    return body["step"], unflatten_tree(body["skeleton"], tensors)
