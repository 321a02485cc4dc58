"""The tensor blob's header in binary (formats 6 and 7): the same fields as the JSON header of formats 3-5.

Why binary: a checkpoint is many small tensors, and the JSON header was ~340 bytes of each blob (dtype
and method names, 64 hex digits of hash, field names, decimal sizes): 0.1% of a bf16 MiniLM, which is
the whole margin by which ZipNN's per-tensor output was smaller than ours. Here the same header takes
~80 bytes: dtype, layout and stream methods as one byte each, sizes as LEB128 varints, hashes as raw
SHA-256 bytes. The header is CRC-32 protected by the blob's footer.

    header  := dtype layout flags ndim dim* [content_hash:32] [delta_base_hash:32] nchunks chunk* [heads_crc:u32, v6]
    dtype   := u8 index into DTYPES, or 255 then varint length and the name in ASCII
    flags   := bit 0: content hash present, bit 1: delta base hash present
    chunk   := bytes:varint pair_base+1:varint (0: none) nstreams:u8 stream* [xxh3:u64, v7]
    stream  := method:u8 (an ASCII letter) raw:varint enc:varint [xxh64:u64, v6 and method "r" only]

Format 7 checksums each chunk's stored bytes once (`xxh3`: XXH3-64 of all its streams as stored);
format 6 had an XXH64 per raw plane, zstd's content checksum in every frame and one CRC-32 over the
frames' first bytes (`heads_crc`). `pack` takes and `unpack` gives the dict the rest of the codec reads
(hashes as hex strings, as in the JSON formats), so every reader of headers works on all formats.
`unpack` raises CorruptCheckpoint on anything malformed.
"""

from __future__ import annotations

import struct

from islands.checkpoint.errors import CorruptCheckpoint

# Append only: a dtype's index is its code in every blob written since.
DTYPES = (
    "float32",
    "bfloat16",
    "float16",
    "float64",
    "complex64",
    "complex128",
    "complex32",
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)
LAYOUTS = ("split", "zstd", "raw")
_NAMED = 255
_HASH_BYTES = 32
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
RAW = "r"  # a plane stored as it is, outside zstd (v6: its XXH64 follows in the header)
LATEST = 7


def put_varint(out: bytearray, value: int, what: str = "header field") -> None:
    """LEB128: 7 bits a byte, low first (the blob header and the container index both use it)."""
    if value < 0:
        raise ValueError(f"a {what} must be >= 0, got {value}")
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def pack(header: dict, version: int = LATEST) -> bytes:
    """The binary header of `header` in format `version` (6 or 7)."""
    if version not in (6, 7):
        raise ValueError(f"binary headers are formats 6 and 7, not {version}")
    v6 = version == 6
    out = bytearray()
    name = header["dtype"]
    if name in DTYPES:
        out.append(DTYPES.index(name))
    else:
        out.append(_NAMED)
        put_varint(out, len(name))
        out += name.encode("ascii")
    out.append(LAYOUTS.index(header["layout"]))
    out.append(("content_hash" in header) | (("delta" in header) << 1))
    put_varint(out, len(header["shape"]))
    for d in header["shape"]:
        put_varint(out, d)
    if "content_hash" in header:
        out += bytes.fromhex(header["content_hash"])
    if "delta" in header:
        out += bytes.fromhex(header["delta"]["base_hash"])
    put_varint(out, len(header["chunks"]))
    for chunk in header["chunks"]:
        put_varint(out, chunk["bytes"])
        put_varint(out, chunk["pair_base"] + 1 if "pair_base" in chunk else 0)
        out.append(len(chunk["streams"]))
        for s in chunk["streams"]:
            out += s["m"].encode("ascii")
            put_varint(out, s["raw"])
            put_varint(out, s["enc"])
            if v6 and s["m"] == RAW:
                out += _U64.pack(s["xxh"])
        if not v6:
            out += _U64.pack(chunk["xxh3"])
    if v6:
        out += _U32.pack(header["heads_crc"])
    return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it) of the LEB128 varint at `pos`; IndexError past the end (unpack says so)."""
    b = data[pos]
    if b < 0x80:
        return b, pos + 1
    value, shift = b & 0x7F, 7
    while True:
        pos += 1
        b = data[pos]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos + 1
        shift += 7
        if shift > 63:
            raise CorruptCheckpoint("tensor blob header holds a number of more than 64 bits")


def unpack(data: bytes, version: int = LATEST) -> dict:
    """The header dict of `pack`. One flat pass with local positions: every tensor of a checkpoint load
    parses one, and a reader object with a method call per byte took ~10 us of a small tensor's ~60."""
    try:
        return _unpack(data, version == 6)
    except IndexError:
        raise CorruptCheckpoint("tensor blob header ends early") from None


def _unpack(data: bytes, v6: bool) -> dict:
    code = data[0]
    pos = 1
    if code == _NAMED:
        n, pos = _read_varint(data, pos)
        if pos + n > len(data):
            raise IndexError
        dtype = data[pos : pos + n].decode("ascii", errors="replace")
        pos += n
    elif code < len(DTYPES):
        dtype = DTYPES[code]
    else:
        raise CorruptCheckpoint(f"unknown dtype code {code} in tensor blob header")
    layout, flags = data[pos], data[pos + 1]
    if layout >= len(LAYOUTS):
        raise CorruptCheckpoint(f"unknown layout code {layout} in tensor blob header")
    ndim, pos = _read_varint(data, pos + 2)
    shape = []
    for _ in range(ndim):
        d, pos = _read_varint(data, pos)
        shape.append(d)
    header: dict = {"dtype": dtype, "shape": shape, "layout": LAYOUTS[layout]}
    for bit, key in ((1, "content_hash"), (2, "delta")):
        if flags & bit:
            if pos + _HASH_BYTES > len(data):
                raise IndexError
            digest = data[pos : pos + _HASH_BYTES].hex()
            header[key] = digest if bit == 1 else {"base_hash": digest}
            pos += _HASH_BYTES
    nchunks, pos = _read_varint(data, pos)
    chunks = []
    for _ in range(nchunks):
        nbytes, pos = _read_varint(data, pos)
        base, pos = _read_varint(data, pos)
        chunk: dict = {"bytes": nbytes}
        if base:
            chunk["pair_base"] = base - 1
        nstreams = data[pos]
        pos += 1
        streams = []
        for _ in range(nstreams):
            method = chr(data[pos])
            raw, pos = _read_varint(data, pos + 1)
            enc, pos = _read_varint(data, pos)
            s = {"m": method, "raw": raw, "enc": enc}
            if v6 and method == RAW:
                if pos + _U64.size > len(data):
                    raise IndexError
                (s["xxh"],) = _U64.unpack_from(data, pos)
                pos += _U64.size
            streams.append(s)
        chunk["streams"] = streams
        if not v6:
            if pos + _U64.size > len(data):
                raise IndexError
            (chunk["xxh3"],) = _U64.unpack_from(data, pos)
            pos += _U64.size
        chunks.append(chunk)
    header["chunks"] = chunks
    if v6:
        if pos + _U32.size > len(data):
            raise IndexError
        (header["heads_crc"],) = _U32.unpack_from(data, pos)
        pos += _U32.size
    if pos != len(data):
        raise CorruptCheckpoint(f"tensor blob header has {len(data) - pos} bytes after its last field")
    return header
