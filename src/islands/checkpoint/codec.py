"""Lossless, dtype-aware tensor codec: float exponents split out and entropy-coded (SOTA-437, LIT-750).

In trained floats only the exponent is redundant (LIT-750: ~40 of 256 exponent values occur and the
stream codes to about a third) while sign and mantissa bits look random. layouts.py cuts each float
dtype into byte planes (the 8-bit exponent alone where it is one, packed two codes per byte by
planes.py); streams.py turns each plane into a checksummed zstd frame: exponent streams Huffman-coded,
mantissa planes Huffman-coded only when a sample across them has structure, stored otherwise.
Integers, bools, 1-byte floats and anything else go through plain zstd.

Optional XOR delta against a base tensor of the same shape and dtype (SOTA-437: deltas against a base
up to K checkpoints back): unchanged exponent and high mantissa bits become zero bytes.

Integrity: every stream's zstd frame carries an XXH64 content checksum and a CRC-32 over its first bytes
(streams.py); the header carries its own CRC-32; the decoded tensor is checked against a SHA-256
content hash when one was stored (collision resistant, so the store also dedups on it). The input
tensor is only ever read.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from islands.checkpoint.errors import CorruptCheckpoint
from islands.checkpoint.layouts import layout_for
from islands.checkpoint.planes import scratch
from islands.checkpoint.streams import coders, decode_frame_into, frame, mantissa_frame

MAGIC = b"ISLT"
# 3: per-dtype plane layouts (layouts.py); 2: one rotated layout for all floats; 1: raw streams with a
# CRC-32. Only 3 is read: no stored checkpoint outlives a format change in this project yet. (The
# whole-plane mantissa gate and the 32/64 KiB zstd blocks changed only encoder choices: the streams are
# the same zstd frames, so blobs written before and after read alike and the version stays 3.)
VERSION = 3
_PREFIX = struct.Struct("<4sBI")  # magic, version, header length
_CRC = struct.Struct("<I")

LAYOUTS = ("split", "zstd", "raw")


@dataclass(frozen=True)
class TensorCodec:
    """How to encode tensors. `layout`: "split" (dtype-aware, default), "zstd" (whole bytes), "raw".

    `chunk_bytes` bounds the size of each checksummed chunk; `zstd_level` is used for non-float data.
    """

    layout: str = "split"
    chunk_bytes: int = 4 << 20
    zstd_level: int = 3

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"TensorCodec.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.chunk_bytes < 64:
            raise ValueError(f"TensorCodec.chunk_bytes must be >= 64, got {self.chunk_bytes}")

    def encode(self, tensor: torch.Tensor, base: torch.Tensor | None = None) -> bytes:
        return encode_tensor(tensor, base=base, codec=self)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpoint(f"unknown dtype {name!r} in checkpoint header")
    return dtype


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's elements as a flat uint8 array in C order. A view when possible; never written to."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_quantized or tensor.is_sparse or tensor.layout != torch.strided:
        raise TypeError(f"only dense strided tensors can be checkpointed, got layout {tensor.layout} "
                        f"(quantized={tensor.is_quantized}); convert with .dequantize() or .to_dense() first")
    if sys.byteorder != "little":
        raise RuntimeError("islands checkpoint codec assumes a little-endian host")
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.reshape(-1)  # a copy only if the input is non-contiguous
    if flat.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def content_hash(tensor: torch.Tensor) -> str:
    """SHA-256 over dtype, shape and element bytes: equal hashes mean interchangeable tensors."""
    return _content_hash_of(dtype_name(tensor.dtype), list(tensor.shape), tensor_bytes(tensor))


def _content_hash_of(dtype: str, shape: list[int], raw: np.ndarray) -> str:
    h = hashlib.sha256(f"{dtype}{shape}".encode())
    h.update(memoryview(raw))
    return h.hexdigest()


def _layout_for(dtype: torch.dtype, requested: str):
    """(layout name actually used, float layout object or None) for this dtype."""
    if requested != "split":
        return requested, None
    planes = layout_for(dtype)
    return ("split", planes) if planes is not None else ("zstd", None)


def _split_streams(planes, piece: np.ndarray, c) -> tuple[list, dict]:
    exponent, others = planes.split(piece)
    streams, extra = [], {}
    if isinstance(exponent, tuple):  # packed pairs of 4-bit codes and the escaped exponents
        base, codes, escaped = exponent
        streams += [frame(codes, c.pairs, "p"), frame(escaped, c.pairs, "x")]
        extra = {"pair_base": base}
    elif exponent is not None:  # too many exponents outside any 15-wide window: the plane whole
        streams.append(frame(exponent, c.elements, "h"))
    for kind, plane in others:
        streams.append(frame(plane, c.elements, "h") if kind == "e" else mantissa_frame(plane, c))
    return streams, extra


def encode_tensor(tensor: torch.Tensor, *, base: torch.Tensor | None = None,
                  codec: TensorCodec | None = None, content_hash: str | bool = True) -> bytes:
    """Encode one tensor into a self-describing, checksummed blob. `tensor` (and `base`) are only read.

    content_hash: True computes the SHA-256 content hash into the header (decode checks it); a string is
    a hash the caller already computed with `content_hash()` (the store does, for dedup: hashed once);
    False leaves it out (the streams' own checksums still guard every stored byte).
    """
    codec = codec or TensorCodec()
    raw = tensor_bytes(tensor)
    dtype = dtype_name(tensor.dtype)
    shape = list(tensor.shape)
    header: dict = {"dtype": dtype, "shape": shape}
    if content_hash is True:
        header["content_hash"] = _content_hash_of(dtype, shape, raw)
    elif isinstance(content_hash, str):
        header["content_hash"] = content_hash
    elif content_hash is not False:
        raise TypeError(f"content_hash must be True, False or a hex digest string, got {type(content_hash).__name__}")
    if base is not None:
        if not isinstance(base, torch.Tensor) or base.dtype != tensor.dtype or base.shape != tensor.shape:
            got = f"{getattr(base, 'dtype', type(base).__name__)} {tuple(getattr(base, 'shape', ()))}"
            raise ValueError(f"delta base must match the tensor's dtype and shape "
                             f"({tensor.dtype} {tuple(tensor.shape)}), got {got}")
        base_raw = tensor_bytes(base)
        raw = np.bitwise_xor(raw, base_raw)  # a new array: neither input is touched
        header["delta"] = {"base_hash": _content_hash_of(dtype, shape, base_raw)}
    layout, planes = _layout_for(tensor.dtype, codec.layout)
    header["layout"] = layout
    c = coders(codec.zstd_level)
    size = planes.size if planes is not None else 1
    step = max(size, codec.chunk_bytes // size * size)
    chunks, payload = [], []
    for start in range(0, len(raw), step):
        piece = raw[start:start + step]
        meta_extra: dict = {}
        if planes is not None:
            streams, meta_extra = _split_streams(planes, piece, c)
        elif layout == "zstd":
            streams = [frame(piece, c.general, "z")]
        else:
            streams = [frame(piece, c.stored, "s")]
        chunks.append({"bytes": len(piece), "streams": [meta for meta, _ in streams], **meta_extra})
        payload.extend(enc for _, enc in streams)
    header["chunks"] = chunks
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([_PREFIX.pack(MAGIC, VERSION, len(head)), head, _CRC.pack(zlib.crc32(head)), *payload])


def read_header(blob: bytes | memoryview) -> tuple[dict, int]:
    """Parse and verify a blob's header; returns (header, offset of the first stream)."""
    view = memoryview(blob)
    if len(view) < _PREFIX.size + _CRC.size:
        raise CorruptCheckpoint(f"tensor blob truncated: {len(view)} bytes is shorter than a header")
    magic, version, head_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptCheckpoint(f"not an islands tensor blob (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise CorruptCheckpoint(f"tensor blob version {version} is not supported (this build reads {VERSION})")
    end = _PREFIX.size + head_len
    if end + _CRC.size > len(view):
        raise CorruptCheckpoint("tensor blob truncated inside its header")
    head = bytes(view[_PREFIX.size:end])
    (crc,) = _CRC.unpack_from(view, end)
    if zlib.crc32(head) != crc:
        raise CorruptCheckpoint("tensor blob header checksum mismatch (header bytes are damaged)")
    try:
        header = json.loads(head)
    except ValueError as exc:  # only reachable if the CRC collided
        raise CorruptCheckpoint(f"tensor blob header is not valid JSON: {exc}") from exc
    return header, end + _CRC.size


def _join_chunk(planes, chunk: dict, decoded: list[np.ndarray], out: np.ndarray, index: int) -> None:
    """Check that a chunk's streams have the shapes its layout needs, then rebuild its bytes."""
    n = out.size // planes.size
    if out.size % planes.size:
        raise CorruptCheckpoint(f"chunk {index} holds {out.size} bytes, not whole {planes.size}-byte elements")
    exponent = None
    if "pair_base" in chunk:
        if not hasattr(planes, "shift") or len(decoded) < 2 or decoded[0].size != (n + 1) // 2 or not 0 <= int(chunk["pair_base"]) <= 255:
            raise CorruptCheckpoint(f"chunk {index}: packed exponents do not fit {n} elements")
        exponent, decoded = (decoded[0], decoded[1], int(chunk["pair_base"])), decoded[2:]
    elif hasattr(planes, "shift"):
        exponent, decoded = (decoded[0] if decoded else None), decoded[1:]
        if exponent is None or exponent.size != n:
            raise CorruptCheckpoint(f"chunk {index}: exponent plane does not hold {n} exponents")
    if len(decoded) != planes.planes or any(d.size != n for d in decoded):
        raise CorruptCheckpoint(f"chunk {index} has planes that do not add up to {out.size} bytes")
    try:
        planes.join(exponent, decoded, out)
    except ValueError as exc:
        raise CorruptCheckpoint(f"chunk {index}: {exc}") from exc


def decode_tensor(blob: bytes | memoryview, *, base: torch.Tensor | None = None,
                  verify: bool = True) -> torch.Tensor:
    """Decode a blob from `encode_tensor`. Raises CorruptCheckpoint on any checksum mismatch.

    `base` must be the same tensor the blob was delta-encoded against (checked by content hash).
    `verify=False` skips only the final SHA-256 over the decoded tensor (also skipped when the blob was
    encoded with content_hash=False); every stream's checksums are always checked.
    """
    view = memoryview(blob)
    header, pos = read_header(view)
    dtype = dtype_from_name(header["dtype"])
    shape = header["shape"]
    layout, planes = _layout_for(dtype, header["layout"])
    if layout != header["layout"]:
        raise CorruptCheckpoint(f"layout {header['layout']!r} is impossible for dtype {header['dtype']}")
    decompressor = coders(TensorCodec.zstd_level).decompressor
    out = np.empty(sum(c["bytes"] for c in header["chunks"]), dtype=np.uint8)
    filled = 0
    for index, chunk in enumerate(header["chunks"]):
        n, decoded = chunk["bytes"], []
        # A chunk held in one stream (integers, bools, the raw layout) decodes straight into the output.
        direct = planes is None and len(chunk["streams"]) == 1 and chunk["streams"][0]["raw"] == n
        for meta in chunk["streams"]:
            enc = view[pos:pos + meta["enc"]]
            pos += meta["enc"]
            if len(enc) != meta["enc"]:
                raise CorruptCheckpoint(f"tensor blob truncated in chunk {index}")
            where = f"chunk {index} of a {header['dtype']} {tuple(shape)} tensor"
            buf = out[filled:filled + n] if direct else scratch(f"decode.{len(decoded)}", meta["raw"], np.uint8)
            decoded.append(decode_frame_into(decompressor, enc, meta, buf, where))
        if planes is not None:
            _join_chunk(planes, chunk, decoded, out[filled:filled + n], index)
        elif not direct or decoded[0].size != n:
            raise CorruptCheckpoint(f"chunk {index} does not hold {n} bytes in one stream")
        filled += n
    if pos != len(view):
        raise CorruptCheckpoint(f"tensor blob has {len(view) - pos} unexpected trailing bytes")
    if "delta" in header:
        if base is None:
            raise ValueError("this tensor was delta-encoded: pass the base tensor it was encoded against")
        base_raw = tensor_bytes(base)
        if _content_hash_of(header["dtype"], shape, base_raw) != header["delta"]["base_hash"]:
            raise CorruptCheckpoint("delta base does not match the one this tensor was encoded against")
        np.bitwise_xor(out, base_raw, out=out)  # out is ours: no second tensor-sized array
    if verify and "content_hash" in header and \
            _content_hash_of(header["dtype"], shape, out) != header["content_hash"]:
        raise CorruptCheckpoint(f"decoded {header['dtype']} {tuple(shape)} tensor does not match its content hash")
    return _tensor_from_bytes(out, dtype, shape)


def _tensor_from_bytes(raw: np.ndarray, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    expected = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    if raw.size != expected:
        raise CorruptCheckpoint(f"decoded {raw.size} bytes, but {dtype_name(dtype)} {tuple(shape)} needs {expected}")
    if raw.size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(shape)
