"""Tensor blobs in the formats earlier islands wrote, made from today's (format 7) blobs for the tests
that check those formats still decode. Every stream's bytes are coded again into a frame with zstd's
content checksum (format 7 frames have none: the chunk's XXH3 covers them):
- format 6: magicless frames, raw planes with their XXH64, one CRC-32 over every frame's first 64
  bytes (`heads_crc`), the binary header;
- formats 3-5: ordinary frames (raw planes in stored zstd frames), each with its own header CRC-32,
  behind the JSON header (4-5) or in front of the streams (3)."""

import json
import struct
import zlib

import xxhash
import zstandard

from islands.checkpoint.codec import blob_header
from islands.checkpoint.codec.tensor import read_header

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_MAGICLESS = zstandard.FORMAT_ZSTD1_MAGICLESS


def _coder(fmt, **params) -> zstandard.ZstdCompressor:
    return zstandard.ZstdCompressor(
        compression_params=zstandard.ZstdCompressionParameters(
            compression_level=1,
            strategy=zstandard.STRATEGY_FAST,
            min_match=7,
            window_log=17,
            hash_log=6,
            chain_log=6,
            search_log=1,
            write_checksum=True,
            format=fmt,
            **params,
        )
    )


_HUFFMAN = {fmt: _coder(fmt) for fmt in (zstandard.FORMAT_ZSTD1, _MAGICLESS)}
_STORED = _coder(zstandard.FORMAT_ZSTD1, target_length=1 << 17)


def frames(blob) -> list[tuple[dict, bytes]]:
    """(stream metadata, frame bytes) of every stream, in order, as the blob stores them."""
    header, offset = read_header(blob)
    out = []
    for chunk in header["chunks"]:
        for meta in chunk["streams"]:
            out.append((meta, bytes(memoryview(blob)[offset : offset + meta["enc"]])))
            offset += meta["enc"]
    return out


def ordinary_frame(frame: bytes) -> bytes:
    """A format 7 (magicless) frame as an ordinary zstd frame, readable by any zstd decoder, blocks as
    they are. Format 7 writes no frame for an empty stream; formats 3-5 always had one."""
    if not frame:
        return zstandard.ZstdCompressor(write_checksum=True).compress(b"")
    return ZSTD_MAGIC + frame


def _data(meta: dict, frame: bytes) -> bytes:
    """A stream's decoded bytes."""
    if meta["m"] == "r" or not frame:
        return frame
    return zstandard.ZstdDecompressor(format=_MAGICLESS).decompress(frame)


def _v7(blob) -> tuple[dict, list[tuple[dict, bytes]]]:
    header, _ = read_header(blob)
    header = json.loads(json.dumps(header))  # a deep copy
    for chunk in header["chunks"]:
        del chunk["xxh3"]
    metas = [meta for chunk in header["chunks"] for meta in chunk["streams"]]
    return header, [(meta, frame) for meta, (_, frame) in zip(metas, frames(blob))]


def v6_blob(blob) -> bytes:
    """A format 7 blob as format 6 wrote it."""
    header, streams = _v7(blob)
    out, crc = [], 0
    for meta, frame in streams:
        data = _data(meta, frame)
        if meta["m"] == "r":
            meta["xxh"] = xxhash.xxh64_intdigest(data)
        elif data or frame:  # format 6 wrote no frame for an empty stream either
            frame = _HUFFMAN[_MAGICLESS].compress(data)
        meta["enc"] = len(frame)
        crc = zlib.crc32(frame[:64], crc)
        out.append(frame)
    header["heads_crc"] = crc
    head = blob_header.pack(header, version=6)
    return struct.pack("<4sB", b"ISLT", 6) + b"".join(out) + head + struct.pack("<II", zlib.crc32(head), len(head))


def legacy_parts(blob) -> tuple[dict, list[bytes]]:
    """(format 5 header dict, ordinary frames with content checksums) for a format 7 blob."""
    header, streams = _v7(blob)
    out = []
    for meta, frame in streams:
        data = _data(meta, frame)
        if meta["m"] == "r":  # formats 3-5 kept noise planes in stored zstd frames
            meta["m"] = "s"
            frame = _STORED.compress(data)
        else:
            frame = _HUFFMAN[zstandard.FORMAT_ZSTD1].compress(data)
        meta.update(enc=len(frame), hcrc=zlib.crc32(frame[:64]))
        out.append(frame)
    return header, out


def legacy_blob(header: dict, streams: list[bytes], version: int = 5) -> bytes:
    """A format 3, 4 or 5 blob from its header dict and ordinary frames."""
    head = json.dumps(header, separators=(",", ":")).encode()
    if version == 3:
        return (
            struct.pack("<4sBI", b"ISLT", 3, len(head)) + head + struct.pack("<I", zlib.crc32(head)) + b"".join(streams)
        )
    return (
        struct.pack("<4sB", b"ISLT", version)
        + b"".join(streams)
        + head
        + struct.pack("<II", zlib.crc32(head), len(head))
    )


def as_version(blob, version: int) -> bytes:
    return v6_blob(blob) if version == 6 else legacy_blob(*legacy_parts(blob), version=version)
