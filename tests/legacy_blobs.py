"""Tensor blobs in the formats earlier islands wrote, made from today's (format 6) blobs for the tests
that check those formats still decode: the same streams, each given back zstd's magic (format 6 frames
are magicless; raw planes go back into stored zstd frames) and its own header CRC-32, behind the JSON
header of formats 4-5 or in front (3)."""

import json
import struct
import zlib

import zstandard

from islands.checkpoint.codec import read_header

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_STORED = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(
    compression_level=1, strategy=zstandard.STRATEGY_FAST, window_log=17, target_length=1 << 17, write_checksum=True))


def frames(blob) -> list[tuple[dict, bytes]]:
    """(stream metadata, frame bytes) of every stream, in order, as the blob stores them."""
    header, offset = read_header(blob)
    out = []
    for chunk in header["chunks"]:
        for meta in chunk["streams"]:
            out.append((meta, bytes(memoryview(blob)[offset:offset + meta["enc"]])))
            offset += meta["enc"]
    return out


def ordinary_frame(frame: bytes) -> bytes:
    """A format 6 (magicless) frame as an ordinary zstd frame, readable by any zstd decoder. Format 6
    writes no frame for an empty stream; earlier formats always had one."""
    if not frame:
        return zstandard.ZstdCompressor(write_checksum=True).compress(b"")
    return ZSTD_MAGIC + frame


def legacy_parts(blob) -> tuple[dict, list[bytes]]:
    """(format 5 header dict, ordinary frames) for a format 6 blob."""
    header, _ = read_header(blob)
    header = json.loads(json.dumps(header))  # a deep copy
    header.pop("heads_crc")
    out, framed = [], iter(frames(blob))
    for chunk in header["chunks"]:
        for meta in chunk["streams"]:
            frame = next(framed)[1]
            if meta["m"] == "r":  # format 6 stores noise planes raw; earlier formats in stored zstd frames
                meta["m"] = "s"
                del meta["xxh"]
                frame = _STORED.compress(frame)
            else:
                frame = ordinary_frame(frame)
            meta.update(enc=len(frame), hcrc=zlib.crc32(frame[:64]))
            out.append(frame)
    return header, out


def legacy_blob(header: dict, streams: list[bytes], version: int = 5) -> bytes:
    """A format 3, 4 or 5 blob from its header dict and ordinary frames."""
    head = json.dumps(header, separators=(",", ":")).encode()
    if version == 3:
        return struct.pack("<4sBI", b"ISLT", 3, len(head)) + head + struct.pack("<I", zlib.crc32(head)) + b"".join(streams)
    return (struct.pack("<4sB", b"ISLT", version) + b"".join(streams) + head
            + struct.pack("<II", zlib.crc32(head), len(head)))


def as_version(blob, version: int) -> bytes:
    return legacy_blob(*legacy_parts(blob), version=version)
