"""The tensor blob's header in binary (format 6): the same fields as the JSON header of formats 3-5.

Why binary: a checkpoint is many small tensors, and the JSON header was ~340 bytes of each blob (dtype
and method names, 64 hex digits of hash, field names, decimal sizes): 0.1% of a bf16 MiniLM, which is
the whole margin by which ZipNN's per-tensor output was smaller than ours. Here the same header takes
~80 bytes: dtype, layout and stream methods as one byte each, sizes as LEB128 varints, hashes as raw
SHA-256 bytes. Format 6 frames also drop zstd's 4-byte magic, and one CRC-32 over every frame's first
bytes replaces the per-stream ones (streams.py). The header is CRC-32 protected by the blob's footer.

    header  := dtype layout flags ndim dim* [content_hash:32] [delta_base_hash:32] nchunks chunk* heads_crc:u32
    dtype   := u8 index into DTYPES, or 255 then varint length and the name in ASCII
    flags   := bit 0: content hash present, bit 1: delta base hash present
    chunk   := bytes:varint pair_base+1:varint (0: none) nstreams:u8 stream*
    stream  := method:u8 (an ASCII letter) raw:varint enc:varint [xxh64:u64, for method "r" only]

`pack` takes and `unpack` gives the dict the rest of the codec reads (hashes as hex strings, as in the
JSON formats), so every reader of headers works on both. `unpack` raises CorruptCheckpoint on anything
malformed.
"""

from __future__ import annotations

import struct

from islands.checkpoint.errors import CorruptCheckpoint

# Append only: a dtype's index is its code in every blob written since.
DTYPES = ("float32", "bfloat16", "float16", "float64", "complex64", "complex128", "complex32", "bool",
          "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
          "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
LAYOUTS = ("split", "zstd", "raw")
_NAMED = 255
_HASH_BYTES = 32
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
RAW = "r"  # a plane stored as it is, outside zstd: its XXH64 follows in the header


def _varint(out: bytearray, value: int) -> None:
    if value < 0:
        raise ValueError(f"a header field must be >= 0, got {value}")
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def pack(header: dict) -> bytes:
    out = bytearray()
    name = header["dtype"]
    if name in DTYPES:
        out.append(DTYPES.index(name))
    else:
        out.append(_NAMED)
        _varint(out, len(name))
        out += name.encode("ascii")
    out.append(LAYOUTS.index(header["layout"]))
    out.append(("content_hash" in header) | (("delta" in header) << 1))
    _varint(out, len(header["shape"]))
    for d in header["shape"]:
        _varint(out, d)
    if "content_hash" in header:
        out += bytes.fromhex(header["content_hash"])
    if "delta" in header:
        out += bytes.fromhex(header["delta"]["base_hash"])
    _varint(out, len(header["chunks"]))
    for chunk in header["chunks"]:
        _varint(out, chunk["bytes"])
        _varint(out, chunk["pair_base"] + 1 if "pair_base" in chunk else 0)
        out.append(len(chunk["streams"]))
        for s in chunk["streams"]:
            out += s["m"].encode("ascii")
            _varint(out, s["raw"])
            _varint(out, s["enc"])
            if s["m"] == RAW:
                out += _U64.pack(s["xxh"])
    out += _U32.pack(header["heads_crc"])
    return bytes(out)


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise CorruptCheckpoint("tensor blob header ends early")
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        value = shift = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if b < 0x80:
                return value
            shift += 7
            if shift > 63:
                raise CorruptCheckpoint("tensor blob header holds a number of more than 64 bits")

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise CorruptCheckpoint("tensor blob header ends early")
        self.pos += n
        return self.data[self.pos - n:self.pos]


def unpack(data: bytes) -> dict:
    r = _Reader(data)
    code = r.byte()
    if code == _NAMED:
        dtype = r.take(r.varint()).decode("ascii", errors="replace")
    elif code < len(DTYPES):
        dtype = DTYPES[code]
    else:
        raise CorruptCheckpoint(f"unknown dtype code {code} in tensor blob header")
    layout = r.byte()
    if layout >= len(LAYOUTS):
        raise CorruptCheckpoint(f"unknown layout code {layout} in tensor blob header")
    flags = r.byte()
    header: dict = {"dtype": dtype, "shape": [r.varint() for _ in range(r.varint())], "layout": LAYOUTS[layout]}
    if flags & 1:
        header["content_hash"] = r.take(_HASH_BYTES).hex()
    if flags & 2:
        header["delta"] = {"base_hash": r.take(_HASH_BYTES).hex()}
    chunks = []
    for _ in range(r.varint()):
        chunk: dict = {"bytes": r.varint()}
        base = r.varint()
        if base:
            chunk["pair_base"] = base - 1
        streams = []
        for _ in range(r.byte()):
            s = {"m": chr(r.byte()), "raw": r.varint(), "enc": r.varint()}
            if s["m"] == RAW:
                (s["xxh"],) = _U64.unpack(r.take(_U64.size))
            streams.append(s)
        chunk["streams"] = streams
        chunks.append(chunk)
    header["chunks"] = chunks
    (header["heads_crc"],) = _U32.unpack(r.take(_U32.size))
    if r.pos != len(data):
        raise CorruptCheckpoint(f"tensor blob header has {len(data) - r.pos} bytes after its last field")
    return header
