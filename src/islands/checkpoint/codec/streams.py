"""The codec's byte planes as streams: which coder each plane gets, and reading it back.

A stream is a zstd frame (magicless: the blob header says what each stream is) or, for a noise plane,
the plane's bytes as they are, read in place. Format 7 checksums what is stored, once per chunk: an
XXH3-64 of all of a chunk's stream bytes, in the blob header (`stored_checksum`, 30 GB/s here),
checked once the chunk is decoded and before the tensor is returned (codec._check_stored says why
then). Damage anywhere in a chunk, frame headers included, is caught there. Format 6 (still read)
checksummed what was decoded: zstd's content checksum in each frame (XXH64, 10 GB/s, computed while
decoding), an XXH64 per raw plane, and a CRC-32 over every frame's first bytes (`heads_crc`), because
zstd ignores some frame header bits; formats 3-5 wrote ordinary frames and one such CRC-32 per stream.
The coders (SOTA-437, LIT-750):
  Huffman  zstd with its LZ stage starved (fast strategy, min match 7, 64-entry tables): what is left is
           the Huffman literal coder, as small as level 19 on exponent planes and ~100x faster
  raw      (format 6 on) a plane the gate finds to be noise, and the raw layout's chunks (format 7):
           stored as they are and read in place, no copy out of a frame
  stored   (formats 3-6, still read) zstd's fast strategy with a target length: raw blocks plus a
           checksum at copy speed (the raw layout of the memory level, and noise planes in formats 3-5)
  general  plain zstd (integers, bools, 1-byte floats)

Huffman streams are cut into zstd blocks smaller than zstd's own 128 KiB: a fresh code table more
often follows the statistics from tensor to tensor, and below 80 KiB zstd skips its "looks
incompressible" shortcut, which samples only a block's first and last 4 KiB (it had stored blocks of
entropy 5.0 bits raw). The block size is set through the window: zstd's blocks are never longer than
its window, so one compress call with window_log 16 writes 64 KiB blocks. (The first v3 encoder cut the
blocks by flushing a streaming compressor every 32/64 KiB, which copies the input and allocates per
flush: 0.5-0.8 ms more per MB of exponent pairs. The frames are the same kind, so both read alike.)
"""

from __future__ import annotations

import threading
import zlib

import numpy as np
import xxhash
import zstandard

from islands.checkpoint.codec.planes import sampled_entropy_bits, scratch
from islands.checkpoint.errors import CorruptCheckpoint

FRAME_HEAD = 64  # formats 3-5: leading bytes of each frame covered by the stream's header CRC-32
# Block sizes as window logs. Measured on the MiniLM bench (docs/checkpointing.md): exponent pairs 64 KiB
# (32 KiB: -0.016% of the bf16 size but encoding and decoding the pairs 4-6% slower, and speed is the
# goal still open); fp16 high bytes 128 KiB (64 KiB: +2.7 KB over the 103 tensors coded one by one, and
# 6% slower to decode; 32 KiB was +4 KB more); gated mantissa planes 32 KiB (-25 KB against 64 KiB).
PAIR_WINDOW_LOG = 16
ELEMENT_WINDOW_LOG = 17
MANTISSA_WINDOW_LOG = 15
# A mantissa plane is Huffman-coded only if 8 K bytes sampled across the whole plane have an order-0
# entropy under 7.9 bits (LIT-750: in trained weights they rarely do; zstd could not keep a gain under
# 1/64 of a block anyway); otherwise it is stored. Sampling the whole plane matters: a chunk often holds
# the end of one tensor and the start of another.
GATE_BITS = 7.9
GATE_MIN_BYTES = 64 << 10  # smaller planes are always offered to the Huffman coder: cheap, zstd decides


# No content checksum in the frames: the chunk's XXH3 covers their stored bytes (format 7).
_FRAMES = dict(write_checksum=False, format=zstandard.FORMAT_ZSTD1_MAGICLESS)


def _huffman_params(window_log: int) -> zstandard.ZstdCompressionParameters:
    return zstandard.ZstdCompressionParameters(
        compression_level=1,
        strategy=zstandard.STRATEGY_FAST,
        min_match=7,
        window_log=window_log,
        hash_log=6,
        chain_log=6,
        search_log=1,
        **_FRAMES,
    )


class Coders:
    """One thread's zstd objects (they are not thread-safe), reused across calls: a fresh context
    allocates and page-faults its work space on first use, which costs more than a small tensor's coding."""

    def __init__(self, level: int):
        self.pairs = zstandard.ZstdCompressor(compression_params=_huffman_params(PAIR_WINDOW_LOG))
        self.elements = zstandard.ZstdCompressor(compression_params=_huffman_params(ELEMENT_WINDOW_LOG))
        self.mantissa = zstandard.ZstdCompressor(compression_params=_huffman_params(MANTISSA_WINDOW_LOG))
        self.general = zstandard.ZstdCompressor(
            compression_params=zstandard.ZstdCompressionParameters.from_level(level, **_FRAMES)
        )
        self.magicless = zstandard.ZstdDecompressor(format=zstandard.FORMAT_ZSTD1_MAGICLESS)
        self.decompressor = zstandard.ZstdDecompressor()  # formats 3-5

    def reader(self, version: int):
        return self.magicless if version >= 6 else self.decompressor


_THREAD_CODERS = threading.local()


def coders(level: int) -> Coders:
    cache = getattr(_THREAD_CODERS, "by_level", None)
    if cache is None:
        cache = _THREAD_CODERS.by_level = {}
    if level not in cache:
        cache[level] = Coders(level)
    return cache[level]


_EMPTY = np.zeros(0, np.uint8)


def frame(data, coder, method: str) -> tuple[dict, bytes]:
    """(stream metadata, one zstd frame of `data`); the metadata goes into the blob header.

    An empty stream (no escaped exponents, the usual case in a small tensor) is no frame at all: zstd
    would spend 9 bytes on it, and decoding it is a call for nothing."""
    raw = data if isinstance(data, (bytes, memoryview)) else memoryview(data).cast("B")
    enc = coder.compress(raw) if len(raw) else b""
    return {"m": method, "raw": len(raw), "enc": len(enc)}, enc


def is_noise(sample: np.ndarray) -> bool:
    """The gate's verdict on a sample of a plane's bytes (all of them are used): store, do not code."""
    return sampled_entropy_bits(sample, samples=sample.size) >= GATE_BITS


def mantissa_frame(plane: np.ndarray, c: Coders) -> tuple[dict, bytes | memoryview]:
    """Huffman-code a mantissa plane only if a sample across it has structure: in trained weights it is
    noise, and is stored raw."""
    if plane.size < GATE_MIN_BYTES or sampled_entropy_bits(plane) < GATE_BITS:
        return frame(plane, c.mantissa, "h")
    return raw_stream(plane)


def stored_checksum(stored) -> int:
    """Format 7's checksum of a chunk's stored bytes: XXH3-64, seed 0 (3x XXH64's speed here, same width)."""
    return xxhash.xxh3_64_intdigest(stored)


def raw_stream(plane: np.ndarray) -> tuple[dict, memoryview]:
    """A plane stored as it is (the gate found it to be noise): no zstd call on either side. Decoding
    reads it where it lies in the blob: as a zstd stored frame it was copied out and checksummed by
    zstd, 0.41 ms per 2 MiB against 0.07 ms for the chunk's XXH3 over it."""
    data = np.ascontiguousarray(plane).data.cast("B")  # .data: the array's memoryview
    return {"m": "r", "raw": len(data), "enc": len(data)}, data


def raw_plane(enc: memoryview, meta: dict, where) -> np.ndarray:
    """A raw stream's plane, read in place from the blob. Format 7 checked it with its chunk; a format
    6 plane carries its own XXH64 in the header."""
    plane = np.frombuffer(enc, np.uint8)
    if plane.size != meta["raw"] or ("xxh" in meta and xxhash.xxh64_intdigest(enc) != meta["xxh"]):
        raise CorruptCheckpoint(f"checksum mismatch in a raw plane of {where}: stored bytes are damaged")
    return plane


def _check_head(enc: memoryview, meta: dict, where: object) -> None:
    """Formats 3-5: the stream's own header CRC-32 (format 6 checks all heads at once: heads_crc)."""
    if "hcrc" in meta and zlib.crc32(enc[:FRAME_HEAD]) != meta["hcrc"]:
        raise CorruptCheckpoint(f"checksum mismatch in a stream header of {where}: stored bytes are damaged")


SMALL_STREAM = 64 << 10  # decoded bytes up to which one decompress call beats a reader into scratch


def decode_frame(decompressor, enc: memoryview, meta: dict, scratch_tag: str, where: object) -> np.ndarray:
    """Check one stream's header CRC (formats 3-5) and decode its frame; returns a byte array, valid until
    this thread decodes into `scratch_tag` again.

    A large stream goes into per-thread scratch through a reader: a fresh buffer per stream costs a page
    fault per 4 KiB on first touch, ~3 us each here (measured 16.5 against 4.2 ms for 22.7 MB in 4 MB
    frames). A small one is one decompress call: its bytes come from the allocator's free lists, and the
    call costs ~1 us where a reader costs ~5. zstd checks a frame's content checksum if it has one
    (formats 3-6); any mismatch, a frame that is short, long, damaged or followed by other bytes raises
    CorruptCheckpoint naming `where`.
    """
    if meta["m"] == "r":
        return raw_plane(enc, meta, where)
    if not meta["enc"] and "hcrc" not in meta:  # format 6: an empty stream has no frame
        if meta["raw"]:
            raise CorruptCheckpoint(f"a stream of {where} should hold {meta['raw']} bytes but has none")
        return _EMPTY
    if meta["raw"] > SMALL_STREAM:
        return decode_frame_into(decompressor, enc, meta, scratch(scratch_tag, meta["raw"], np.uint8), where)
    if "hcrc" in meta:
        _check_head(enc, meta, where)
    try:
        data = decompressor.decompress(enc, max_output_size=meta["raw"] + 1, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptCheckpoint(f"{where} is damaged: {exc}") from exc
    if len(data) != meta["raw"]:
        raise CorruptCheckpoint(f"{where} decoded to {len(data)} bytes, expected {meta['raw']}")
    return np.frombuffer(data, np.uint8)


def decode_frame_into(decompressor, enc: memoryview, meta: dict, buf: np.ndarray, where: object) -> np.ndarray:
    """decode_frame, but into `buf` (exactly meta["raw"] bytes; a chunk that is one stream decodes straight
    into the tensor's output); returns `buf`.

    Reading one byte past the end makes zstd finish the frame (and verify its content checksum, if any).
    A raw stream (the raw layout's, format 7) is copied.
    """
    if meta["m"] == "r":
        np.copyto(buf, raw_plane(enc, meta, where))  # raises on a size mismatch before copying
        return buf
    _check_head(enc, meta, where)
    try:
        with decompressor.stream_reader(enc) as reader:
            view, got = buf.data, 0
            while got < buf.size:
                step = reader.readinto(view[got:])
                if step == 0:
                    break
                got += step
            extra = reader.read(1)
    except zstandard.ZstdError as exc:  # includes a frame's content checksum failing
        raise CorruptCheckpoint(f"{where} is damaged: {exc}") from exc
    if extra:
        raise CorruptCheckpoint(f"{where} decoded to more than the {meta['raw']} bytes expected")
    if got != meta["raw"]:
        raise CorruptCheckpoint(f"{where} decoded to {got} bytes, expected {meta['raw']}")
    return buf
