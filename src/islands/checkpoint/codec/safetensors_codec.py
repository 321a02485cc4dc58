"""Compress any .safetensors file with the tensor codec, and restore it byte for byte.

The safetensors header (JSON, with its exact bytes, key order and __metadata__) is restored verbatim,
so decompression rebuilds the original file exactly; each tensor's bytes go through `encode_tensor` with
its real dtype so floats get the exponent split. Unknown dtypes are coded as raw bytes (still exact).

Container format 2 (`islands ckpt compress` since issue #20 item 7):

    b"ISLS" | u32 version (2) | varint n | index: one zstd frame of n bytes | u32 CRC-32 of all before it
    | the streams of tensor 0 | the streams of tensor 1 | ...

    index (before zstd) :=
        u8 codec format of the tensor parts (7)
        u8 header form: 0 the header's bytes as they are, 1 the header without its data offsets
        varint length, that text; [form 1: varint count of trailing pad spaces]
        varint data region length
        varint gap count, gap*          gap := varint begin, varint end, the bytes (padding no tensor claims)
        varint tensor count, part*      part := varint length, the tensor's binary codec header (blob_header.py)
        16 bytes: XXH3-128 of the whole original file

Why (issue #20 item 7): the first container (format 1, below) spent ~350 bytes per tensor beside the codec's
streams (its JSON index, a SHA-256 and a blob frame per tensor), which left the CLI's output 0.07-0.09%
larger than ZipNN's per-tensor output on bf16 and fp16 MiniLM although the streams were smaller. Format 2
spends 18.5-23.4 bytes per tensor there (docs/checkpointing.md, "Container"). Each tensor is now stored as
its codec streams alone; its header (the XXH3 of every chunk, the stream sizes) sits in the index, where the
headers of all tensors and the safetensors header compress together. Fields the index implies are not
stored: every tensor's position in the blob region is the sum of the stream sizes before it, and when the
safetensors header lists its tensors contiguously in data order (what the safetensors library writes) its
data offsets follow from the tensors' sizes and are dropped from the text; the writer rebuilds the exact
header bytes from the reduced text and keeps the full text whenever they differ. Small integer tensors are
coded at zstd level 19 (MiniLM's int64 position ids: 581 against 794 bytes at level 3).

Integrity: the CRC-32 covers the magic, version and the compressed index; each chunk of stored stream
bytes is checked against its XXH3-64 from the index as it is decoded (codec format 7); the stream sizes
must add up to the file's length; the rebuilt file is checked against the original's XXH3-128 before
it is written. Format 1 had a CRC-32 per blob and a SHA-256 per tensor inside each blob (32 bytes per
tensor) instead of the one whole-file hash.

Format 1 (still read): b"ISLS" | u32 1 | u64 index length | index JSON | u32 CRC-32 of index | whole
codec blobs, the JSON holding the safetensors header text and per tensor its name, byte range, offset,
length and CRC-32.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import torch
import xxhash
import zstandard

from islands.checkpoint.codec import blob_header
from islands.checkpoint.codec.tensor import (
    VERSION as CODEC_VERSION,
    TensorCodec,
    _layout_for,
    blob_parts,
    decode_parts,
    decode_tensor,
    encode_tensor,
    tensor_bytes,
)
from islands.checkpoint.errors import CorruptCheckpoint

_MAGIC = b"ISLS"
VERSION = 2
READS = (1, 2)
_PREFIX = struct.Struct("<4sI")  # magic, version: the same in every format
_V1_HEAD = struct.Struct("<4sIQ")
_CRC = struct.Struct("<I")
_HASH_BYTES = 16  # XXH3-128 of the original file
_RAW_HEADER, _REDUCED_HEADER = 0, 1
INDEX_LEVEL = 19  # the index is a few KB: the strongest usual level costs ~1 ms
SMALL_GENERAL = 64 << 10  # integer / bool / 1-byte-float tensors up to this size are coded at...
SMALL_GENERAL_LEVEL = 19  # ...this zstd level (bigger ones keep the codec's level 3: speed)
_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}


def read_safetensors_header(data: bytes | memoryview) -> tuple[bytes, dict, int]:
    """(exact header bytes, parsed header, offset where the data region starts)."""
    if len(data) < 8:
        raise ValueError("not a safetensors file: shorter than its 8-byte header length")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > len(data) - 8:
        raise ValueError(f"not a safetensors file: header length {n} exceeds the file size {len(data)}")
    raw = bytes(data[8 : 8 + n])
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"not a safetensors file: header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file: header is not a JSON object")
    return raw, header, 8 + n


def _tensors(header: dict) -> list[tuple[str, dict]]:
    return [(name, info) for name, info in header.items() if name != "__metadata__"]


def _as_tensor(chunk: np.ndarray, info: dict) -> torch.Tensor:
    """The tensor a safetensors entry describes, or its bytes as uint8 when the dtype is unknown or the
    byte count does not match the shape."""
    dtype = _DTYPES.get(info["dtype"])
    if dtype is not None and chunk.size == int(np.prod(info["shape"], dtype=np.int64)) * dtype.itemsize:
        return (
            torch.from_numpy(chunk).view(dtype).reshape(info["shape"])
            if chunk.size
            else torch.empty(info["shape"], dtype=dtype)
        )
    return torch.from_numpy(chunk)  # unknown dtype: exact bytes


def _codec_for(tensor: torch.Tensor, codec: TensorCodec) -> TensorCodec:
    """Small tensors zstd codes whole (integers, bools, 1-byte floats) get a stronger level: a few ms at
    most, and tens to hundreds of bytes each (a layout that is not "split" is the caller's choice)."""
    if (
        codec.layout == "split"
        and _layout_for(tensor.dtype, "split")[1] is None
        and tensor.numel() * tensor.element_size() <= SMALL_GENERAL
        and codec.zstd_level < SMALL_GENERAL_LEVEL
    ):
        return dataclasses.replace(codec, zstd_level=SMALL_GENERAL_LEVEL)
    return codec


def _gaps(ranges: list[tuple[int, int]], data_len: int) -> list[tuple[int, int]]:
    """The byte ranges of the data region that no tensor claims (padding), in order."""
    gaps, pos = [], 0
    for b, e in sorted(ranges):
        if b > pos:
            gaps.append((pos, b))
        pos = max(pos, e)
    if pos < data_len:
        gaps.append((pos, data_len))
    return gaps


# ---- the header without its data offsets ------------------------------------------------------------


def _dump(header: dict) -> bytes:
    """JSON as the safetensors library writes it (no spaces, UTF-8 as it is)."""
    return json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _expand_header(reduced: bytes, sizes: list[int], pad: int) -> bytes:
    """The header bytes a reduced text stands for: each tensor's data offsets appended to its entry,
    contiguous from 0 in the order of the entries, then `pad` spaces."""
    try:
        header = json.loads(reduced)
    except ValueError as exc:  # only reachable if the index CRC collided
        raise CorruptCheckpoint(f"compressed file: its safetensors header is not JSON ({exc})") from exc
    entries = _tensors(header) if isinstance(header, dict) else []
    if len(entries) != len(sizes) or not all(isinstance(info, dict) for _, info in entries):
        raise CorruptCheckpoint("compressed file: its safetensors header does not list the tensors it stores")
    pos = 0
    for (_, info), size in zip(entries, sizes):
        info["data_offsets"] = [pos, pos + size]
        pos += size
    return _dump(header) + b" " * pad


def _reduce_header(raw: bytes, header: dict) -> tuple[bytes, int] | None:
    """(the header text without data offsets, trailing spaces), or None when that text would not give
    back exactly `raw` (tensors not contiguous in entry order, another key order, other JSON spacing or
    escapes, ...): the container then keeps `raw` as it is."""
    entries = _tensors(header)
    sizes, pos = [], 0
    for _, info in entries:
        if not isinstance(info, dict) or list(info)[-1:] != ["data_offsets"]:
            return None
        b, e = info["data_offsets"]
        if b != pos or e < b:
            return None
        sizes.append(e - b)
        pos = e
    reduced = _dump(
        {
            name: ({k: v for k, v in info.items() if k != "data_offsets"} if name != "__metadata__" else info)
            for name, info in header.items()
        }
    )
    pad = len(raw) - len(raw.rstrip(b" "))
    try:
        same = _expand_header(reduced, sizes, pad) == raw
    except CorruptCheckpoint:
        same = False
    return (reduced, pad) if same else None


# ---- varints --------------------------------------------------------------------------------------


def _put(out: bytearray, value: int) -> None:
    blob_header.put_varint(out, value, "container field")


class _Reader:
    """Reads the index; any read past its end or a malformed number is damage."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def varint(self) -> int:
        value, shift = 0, 0
        while True:
            if self.pos >= len(self.data) or shift > 63:
                raise CorruptCheckpoint("compressed file: its index ends early or holds a malformed number")
            b = self.data[self.pos]
            self.pos += 1
            value |= (b & 0x7F) << shift
            if b < 0x80:
                return value
            shift += 7

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise CorruptCheckpoint("compressed file: its index ends early")
        self.pos += n
        return self.data[self.pos - n : self.pos]


# ---- compress -------------------------------------------------------------------------------------


def compress_file(src: str | os.PathLike, dst: str | os.PathLike, *, codec: TensorCodec | None = None) -> dict:
    """Compress safetensors `src` into `dst` (container format 2). Returns stats: bytes in/out, ratio,
    tensors, and `index_bytes`: everything in the file that is not a tensor's codec streams."""
    codec = codec or TensorCodec()
    data = memoryview(Path(src).read_bytes())
    raw_header, header, start = read_safetensors_header(data)
    data_len = len(data) - start
    heads, streams, ranges, version = [], [], [], CODEC_VERSION
    for _, info in _tensors(header):
        b, e = info["data_offsets"]
        if not 0 <= b <= e <= data_len:
            raise ValueError(f"not a safetensors file: data offsets {[b, e]} outside the {data_len}-byte data region")
        chunk = np.frombuffer(bytearray(data[start + b : start + e]), dtype=np.uint8)  # writable: no torch warning
        tensor = _as_tensor(chunk, info)
        head, body, version = blob_parts(encode_tensor(tensor, codec=_codec_for(tensor, codec), content_hash=False))
        heads.append(head)
        streams.append(body)
        ranges.append((b, e))
    index = bytearray([version])
    reduced = _reduce_header(raw_header, header)
    if reduced is None:
        index.append(_RAW_HEADER)
        _put(index, len(raw_header))
        index += raw_header
    else:
        index.append(_REDUCED_HEADER)
        _put(index, len(reduced[0]))
        index += reduced[0]
        _put(index, reduced[1])
    _put(index, data_len)
    gaps = _gaps(ranges, data_len)
    _put(index, len(gaps))
    for b, e in gaps:
        _put(index, b)
        _put(index, e)
        index += data[start + b : start + e]
    _put(index, len(heads))
    for head in heads:
        _put(index, len(head))
        index += head
    index += xxhash.xxh3_128_digest(data)
    packed = zstandard.ZstdCompressor(level=INDEX_LEVEL, write_checksum=False).compress(bytes(index))
    lead = bytearray(_PREFIX.pack(_MAGIC, VERSION))
    _put(lead, len(packed))
    lead += packed
    lead += _CRC.pack(zlib.crc32(lead))
    with open(dst, "wb") as f:
        f.write(lead)
        for body in streams:
            f.write(body)
    size = len(lead) + sum(len(body) for body in streams)
    return {
        "src": str(src),
        "dst": str(dst),
        "bytes_in": len(data),
        "bytes_out": size,
        "ratio": size / max(1, len(data)),
        "tensors": len(heads),
        "format": VERSION,
        "index_bytes": len(lead),
    }


# ---- decompress -----------------------------------------------------------------------------------


def decompress_file(src: str | os.PathLike, dst: str | os.PathLike) -> dict:
    """Rebuild the original safetensors file from `src` (checksums verified) into `dst`. Reads
    container formats 1 and 2."""
    data = memoryview(Path(src).read_bytes())
    if len(data) < _PREFIX.size or bytes(data[:4]) != _MAGIC:
        raise CorruptCheckpoint(f"{src} is not an islands-compressed safetensors file")
    _, version = _PREFIX.unpack_from(data, 0)
    if version == 1:
        out, tensors = _decompress_v1(data, src)
    elif version == 2:
        out, tensors = _decompress_v2(data, src)
    else:
        raise CorruptCheckpoint(
            f"{src}: container format {version} is not supported (this build reads {' and '.join(map(str, READS))})"
        )
    Path(dst).write_bytes(out.data)
    return {
        "src": str(src),
        "dst": str(dst),
        "bytes_in": len(data),
        "bytes_out": len(out),
        "tensors": tensors,
        "format": version,
    }


def _decompress_v2(data: memoryview, src) -> tuple[np.ndarray, int]:
    lead = _Reader(bytes(data[: _PREFIX.size + 10]))
    lead.pos = _PREFIX.size
    n = lead.varint()
    end = lead.pos + n
    if end + _CRC.size > len(data) or zlib.crc32(data[:end]) != _CRC.unpack_from(data, end)[0]:
        raise CorruptCheckpoint(f"{src}: index checksum mismatch (file damaged or truncated)")
    try:
        r = _Reader(zstandard.ZstdDecompressor().decompress(data[lead.pos : end]))
    except zstandard.ZstdError as exc:  # only reachable if the CRC collided
        raise CorruptCheckpoint(f"{src}: the index does not decompress ({exc})") from exc
    codec_version, form = r.take(2)
    if codec_version not in (6, 7) or form not in (_RAW_HEADER, _REDUCED_HEADER):
        raise CorruptCheckpoint(
            f"{src}: tensor format {codec_version} / header form {form} in the index are not supported by this build"
        )
    text = r.take(r.varint())
    pad = r.varint() if form == _REDUCED_HEADER else 0
    data_len = r.varint()
    gaps = []
    for _ in range(r.varint()):
        b, e = r.varint(), r.varint()
        gaps.append((b, e, r.take(e - b) if e >= b else b""))
    heads = [r.take(r.varint()) for _ in range(r.varint())]
    want = r.take(_HASH_BYTES)
    if r.pos != len(r.data):
        raise CorruptCheckpoint(f"{src}: the index has {len(r.data) - r.pos} bytes after its last field")
    parsed = [_parts_of(head, codec_version) for head in heads]
    raw_header = text if form == _RAW_HEADER else _expand_header(text, [size for size, _ in parsed], pad)
    _, header, _ = read_safetensors_header(struct.pack("<Q", len(raw_header)) + raw_header)
    entries = _tensors(header)
    if len(entries) != len(heads):
        raise CorruptCheckpoint(f"{src}: the index holds {len(heads)} tensors, its header lists {len(entries)}")
    pos = end + _CRC.size
    if pos + sum(stored for _, stored in parsed) != len(data):
        raise CorruptCheckpoint(
            f"{src}: the tensors' streams take {sum(s for _, s in parsed)} bytes, the file "
            f"holds {len(data) - pos} after its index (truncated or extended)"
        )
    top = 8 + len(raw_header)
    out = np.empty(top + data_len, dtype=np.uint8)
    out[:8] = np.frombuffer(struct.pack("<Q", len(raw_header)), dtype=np.uint8)
    out[8:top] = np.frombuffer(raw_header, dtype=np.uint8)
    region = out[top:]
    for b, e, raw in gaps:
        if not 0 <= b <= e <= data_len:
            raise CorruptCheckpoint(f"{src}: a padding range {[b, e]} outside the data region")
        region[b:e] = np.frombuffer(raw, dtype=np.uint8)
    for (name, info), head, (size, stored) in zip(entries, heads, parsed):
        b, e = info["data_offsets"]
        if e - b != size or not 0 <= b <= e <= data_len:
            raise CorruptCheckpoint(f"{src}: tensor {name!r} holds {size} bytes, its header says {[b, e]}")
        try:
            region[b:e] = tensor_bytes(decode_parts(head, data[pos : pos + stored], version=codec_version))
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(f"{src}: tensor {name!r}: {exc}") from None
        pos += stored
    if xxhash.xxh3_128_digest(out.data) != want:
        raise CorruptCheckpoint(f"{src}: the rebuilt file does not match the original's XXH3-128")
    return out, len(heads)


def _parts_of(head: bytes, version: int) -> tuple[int, int]:
    """(decoded bytes, stored stream bytes) of a tensor from its codec header."""
    chunks = blob_header.unpack(head, version)["chunks"]
    return sum(c["bytes"] for c in chunks), sum(s["enc"] for c in chunks for s in c["streams"])


def _decompress_v1(data: memoryview, src) -> tuple[np.ndarray, int]:
    """Format 1: JSON index, whole codec blobs each under a CRC-32 (and a SHA-256 of its tensor)."""
    if len(data) < _V1_HEAD.size:
        raise CorruptCheckpoint(f"{src} is not an islands-compressed safetensors file")
    _, _, n = _V1_HEAD.unpack_from(data, 0)
    meta = bytes(data[_V1_HEAD.size : _V1_HEAD.size + n])
    if len(data) < _V1_HEAD.size + n + 4 or zlib.crc32(meta) != struct.unpack_from("<I", data, _V1_HEAD.size + n)[0]:
        raise CorruptCheckpoint(f"{src}: index checksum mismatch (file damaged or truncated)")
    index = json.loads(meta)
    base = _V1_HEAD.size + n + 4
    raw_header = index["header"].encode("utf-8")
    top = 8 + len(raw_header)
    out = np.zeros(top + index["data_len"], dtype=np.uint8)
    out[:top] = np.frombuffer(struct.pack("<Q", len(raw_header)) + raw_header, dtype=np.uint8)
    region = out[top:]
    for b, e, hexdata in index["gaps"]:
        region[b:e] = np.frombuffer(bytes.fromhex(hexdata), dtype=np.uint8)
    for t in index["tensors"]:
        blob = data[base + t["offset"] : base + t["offset"] + t["length"]]
        if len(blob) != t["length"] or zlib.crc32(blob) != t["crc"]:
            raise CorruptCheckpoint(f"{src}: checksum mismatch in tensor {t['name']!r}")
        region[t["begin"] : t["end"]] = tensor_bytes(decode_tensor(blob))
    return out, len(index["tensors"])
