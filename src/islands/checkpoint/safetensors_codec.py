"""Compress any .safetensors file with the tensor codec, and restore it byte for byte.

The safetensors header (JSON, with its exact bytes, key order and __metadata__) is kept verbatim, so
decompression rebuilds the original file exactly; each tensor's bytes go through `encode_tensor` with
its real dtype so floats get the exponent split. Unknown dtypes are coded as raw bytes (still exact).

Container: b"ISLS" | u32 version | u64 index length | index JSON | u32 CRC-32 of index | blobs.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from islands.checkpoint.codec import TensorCodec, decode_tensor, encode_tensor, tensor_bytes
from islands.checkpoint.errors import CorruptCheckpoint

_MAGIC = b"ISLS"
_HEAD = struct.Struct("<4sIQ")
_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
           "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32,
           "F32": torch.float32, "F64": torch.float64, "I64": torch.int64, "U64": torch.uint64,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64}


def read_safetensors_header(data: bytes | memoryview) -> tuple[bytes, dict, int]:
    """(exact header bytes, parsed header, offset where the data region starts)."""
    if len(data) < 8:
        raise ValueError("not a safetensors file: shorter than its 8-byte header length")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > len(data) - 8:
        raise ValueError(f"not a safetensors file: header length {n} exceeds the file size {len(data)}")
    raw = bytes(data[8:8 + n])
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"not a safetensors file: header is not JSON ({exc})") from exc
    return raw, header, 8 + n


def compress_file(src: str | os.PathLike, dst: str | os.PathLike, *, codec: TensorCodec | None = None) -> dict:
    """Compress safetensors `src` into `dst`. Returns stats: bytes in/out, ratio, tensors."""
    codec = codec or TensorCodec()
    data = memoryview(Path(src).read_bytes())
    raw_header, header, start = read_safetensors_header(data)
    data_len = len(data) - start
    index, blobs, offset = [], [], 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        chunk = np.frombuffer(bytearray(data[start + b:start + e]), dtype=np.uint8)  # writable: no torch warning
        dtype = _DTYPES.get(info["dtype"])
        if dtype is not None and (e - b) == int(np.prod(info["shape"], dtype=np.int64)) * dtype.itemsize:
            tensor = torch.from_numpy(chunk).view(dtype).reshape(info["shape"]) if e > b else torch.empty(info["shape"], dtype=dtype)
        else:
            tensor = torch.from_numpy(chunk)  # unknown dtype: exact bytes
        blob = encode_tensor(tensor, codec=codec)
        index.append({"name": name, "begin": b, "end": e, "offset": offset, "length": len(blob),
                      "crc": zlib.crc32(blob)})
        blobs.append(blob)
        offset += len(blob)
    covered = sorted((t["begin"], t["end"]) for t in index)
    gaps = []
    pos = 0
    for b, e in covered:  # bytes no tensor claims (padding) are kept verbatim too
        if b > pos:
            gaps.append([pos, b, bytes(data[start + pos:start + b]).hex()])
        pos = max(pos, e)
    if pos < data_len:
        gaps.append([pos, data_len, bytes(data[start + pos:]).hex()])
    meta = json.dumps({"header": raw_header.decode("utf-8"), "data_len": data_len, "tensors": index,
                       "gaps": gaps}).encode()
    out = b"".join([_HEAD.pack(_MAGIC, 1, len(meta)), meta, struct.pack("<I", zlib.crc32(meta)), *blobs])
    Path(dst).write_bytes(out)
    return {"src": str(src), "dst": str(dst), "bytes_in": len(data), "bytes_out": len(out),
            "ratio": len(out) / max(1, len(data)), "tensors": len(index)}


def decompress_file(src: str | os.PathLike, dst: str | os.PathLike) -> dict:
    """Rebuild the original safetensors file from `src` (checksums verified) into `dst`."""
    data = memoryview(Path(src).read_bytes())
    if len(data) < _HEAD.size or bytes(data[:4]) != _MAGIC:
        raise CorruptCheckpoint(f"{src} is not an islands-compressed safetensors file")
    _, version, n = _HEAD.unpack_from(data, 0)
    meta = bytes(data[_HEAD.size:_HEAD.size + n])
    if len(data) < _HEAD.size + n + 4 or zlib.crc32(meta) != struct.unpack_from("<I", data, _HEAD.size + n)[0]:
        raise CorruptCheckpoint(f"{src}: index checksum mismatch (file damaged or truncated)")
    index = json.loads(meta)
    base = _HEAD.size + n + 4
    raw_header = index["header"].encode("utf-8")
    region = np.zeros(index["data_len"], dtype=np.uint8)
    for b, e, hexdata in index["gaps"]:
        region[b:e] = np.frombuffer(bytes.fromhex(hexdata), dtype=np.uint8)
    for t in index["tensors"]:
        blob = data[base + t["offset"]:base + t["offset"] + t["length"]]
        if len(blob) != t["length"] or zlib.crc32(blob) != t["crc"]:
            raise CorruptCheckpoint(f"{src}: checksum mismatch in tensor {t['name']!r}")
        region[t["begin"]:t["end"]] = tensor_bytes(decode_tensor(blob))
    out = struct.pack("<Q", len(raw_header)) + raw_header + region.tobytes()
    Path(dst).write_bytes(out)
    return {"src": str(src), "dst": str(dst), "bytes_in": len(data), "bytes_out": len(out),
            "tensors": len(index["tensors"])}
