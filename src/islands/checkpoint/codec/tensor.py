"""Lossless, dtype-aware tensor codec: float exponents split out and entropy-coded (SOTA-437, LIT-750).

In trained floats only the exponent is redundant (LIT-750: ~40 of 256 exponent values occur and the
stream codes to about a third) while sign and mantissa bits look random. layouts.py cuts each float
dtype into byte planes (the 8-bit exponent alone where it is one, packed two codes per byte by
planes.py); streams.py turns each plane into a checksummed zstd frame: exponent streams Huffman-coded,
mantissa planes Huffman-coded only when a sample across them has structure, stored otherwise.
Integers, bools, 1-byte floats and anything else go through plain zstd.

Optional XOR delta against a base tensor of the same shape and dtype (SOTA-437: deltas against a base
up to K checkpoints back): unchanged exponent and high mantissa bits become zero bytes.

Blob (format 7): magic, version, the streams, the header (binary: blob_header.py), its CRC-32, its length; encode_tensor
returns it as a read-only memoryview over one numpy buffer (see encode_tensor for why).

Integrity: every chunk's stored bytes carry an XXH3-64, checked once the chunk is decoded and before
the tensor is returned (_check_stored); the header carries its own CRC-32; the decoded tensor is checked
against a SHA-256 content hash when one is known (in the blob, or passed in from the store's manifest;
collision resistant, so the store also dedups on it). The input tensor is only ever read.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from islands.checkpoint.codec import blob_header
from islands.checkpoint.codec.layouts import layout_for
from islands.checkpoint.codec.streams import (
    FRAME_HEAD,
    coders,
    decode_frame,
    decode_frame_into,
    frame,
    mantissa_frame,
    raw_stream,
    stored_checksum,
)
from islands.checkpoint.errors import CorruptCheckpoint

MAGIC = b"ISLT"
# 7: one XXH3-64 per chunk over its stored bytes instead of a checksum of every decoded plane (zstd's
#    content checksum in each frame, an XXH64 per raw plane, heads_crc), at 3x the speed; it covers
#    the frame headers too; the raw layout's chunks are raw streams instead of stored zstd frames.
# 6: the header in binary (blob_header.py: ~80 instead of ~340 bytes per tensor); magicless frames under
#    one CRC-32 of all frame heads instead of one per stream; no frame for an empty stream; noise planes
#    stored raw with their XXH64 in the header (streams.py).
# 5: an fp32 chunk may carry its low 16 bits as one stored plane of words (layouts.py); v4 readers would
#    take that for a damaged chunk, so the version says it instead.
# 4: the header moves to the end (magic, version | streams | header JSON | CRC-32 | header length), so the
#    encoder writes each stream once, straight into one output buffer, instead of keeping every stream
#    alive and joining them behind a header whose length is known only at the end.
# 3: magic, version, header length | header JSON | CRC-32 | streams; per-dtype plane layouts. Still read.
# 2: one rotated layout for all floats; 1: raw streams with a CRC-32. Refused with a message.
VERSION = 7
READS = (3, 4, 5, 6, 7)
_PREFIX = struct.Struct("<4sB")  # magic, version
_V3_HEAD_LEN = struct.Struct("<I")  # v3: the header length right after the prefix
_CRC = struct.Struct("<I")
_FOOTER = struct.Struct("<II")  # v4 on: CRC-32 of the header, header length

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

    def encode(self, tensor: torch.Tensor, base: torch.Tensor | None = None) -> memoryview:
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
        raise TypeError(
            f"only dense strided tensors can be checkpointed, got layout {tensor.layout} "
            f"(quantized={tensor.is_quantized}); convert with .dequantize() or .to_dense() first"
        )
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
    h.update(raw.data)
    return h.hexdigest()


def _layout_for(dtype: torch.dtype, requested: str):
    """(layout name actually used, float layout object or None) for this dtype."""
    if requested != "split":
        return requested, None
    planes = layout_for(dtype)
    return ("split", planes) if planes is not None else ("zstd", None)


def _split_streams(planes, piece: np.ndarray, c) -> tuple[list, dict]:
    exponent, others = planes.split(piece)
    streams: list[tuple[dict, bytes | memoryview]] = []
    extra: dict = {}
    if isinstance(exponent, tuple):  # packed pairs of 4-bit codes and the escaped exponents
        base, codes, escaped = exponent
        streams += [frame(codes, c.pairs, "p"), frame(escaped, c.pairs, "x")]
        extra = {"pair_base": base}
    elif exponent is not None:  # too many exponents outside any 15-wide window: the plane whole
        streams.append(frame(exponent, c.elements, "h"))
    for kind, plane in others:
        if kind == "e":
            streams.append(frame(plane, c.elements, "h"))
        elif kind == "s":  # the layout probed it already
            streams.append(raw_stream(plane))
        else:
            streams.append(mantissa_frame(plane, c))
    return streams, extra


def encode_tensor(
    tensor: torch.Tensor,
    *,
    base: torch.Tensor | None = None,
    codec: TensorCodec | None = None,
    content_hash: str | bool = True,
) -> memoryview:
    """Encode one tensor into a self-describing, checksummed blob. `tensor` (and `base`) are only read.

    The blob is a read-only, bytes-like memoryview over a buffer of its own (len, slicing, ==, writing
    to a file, b"".join and zlib.crc32 work as with bytes; `bytes(blob)` makes a copy).

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
            raise ValueError(
                f"delta base must match the tensor's dtype and shape ({tensor.dtype} {tuple(tensor.shape)}), got {got}"
            )
        base_raw = tensor_bytes(base)
        raw = np.bitwise_xor(raw, base_raw)  # a new array: neither input is touched
        header["delta"] = {"base_hash": _content_hash_of(dtype, shape, base_raw)}
    layout, planes = _layout_for(tensor.dtype, codec.layout)
    header["layout"] = layout
    c = coders(codec.zstd_level)
    size = planes.size if planes is not None else 1
    step = max(size, codec.chunk_bytes // size * size)
    # One output buffer, written once: each stream goes in as soon as zstd returns it (its bytes object
    # is freed and reused for the next), where v3 kept them all and joined them behind the header. A
    # numpy buffer of 4 MiB and more is advised into huge pages, so the fresh output costs a fault per
    # 2 MiB instead of per 4 KiB (measured on the full bench: 18-25 K faults per encode before).
    # Upper bound: the streams of a chunk hold at most its bytes plus one, and zstd adds at most 1/256
    # plus a frame and block overhead per stream.
    n_chunks = -(-len(raw) // step)
    out = np.empty(_PREFIX.size + len(raw) + len(raw) // 128 + 2048 * n_chunks + 4096, dtype=np.uint8)
    _PREFIX.pack_into(out.data, 0, MAGIC, VERSION)
    pos, chunks = _PREFIX.size, []
    for start in range(0, len(raw), step):
        piece = raw[start : start + step]
        meta_extra: dict = {}
        if planes is not None:
            streams, meta_extra = _split_streams(planes, piece, c)
        elif layout == "zstd":
            streams = [frame(piece, c.general, "z")]
        else:
            streams = [raw_stream(piece)]
        begin = pos
        for _, enc in streams:
            out, pos = _put(out, pos, enc)
        chunks.append(
            {
                "bytes": len(piece),
                "streams": [meta for meta, _ in streams],
                **meta_extra,
                "xxh3": stored_checksum(out[begin:pos]),
            }
        )
        del streams
    header["chunks"] = chunks
    head = blob_header.pack(header)
    out, pos = _put(out, pos, head)
    out, pos = _put(out, pos, _FOOTER.pack(zlib.crc32(head), len(head)))
    if pos < out.size // 2:  # small or very compressible: do not keep the whole bound alive with the blob
        out = out[:pos].copy()
    return out[:pos].data.toreadonly()


def _put(out: np.ndarray, pos: int, data) -> tuple[np.ndarray, int]:
    """Copy `data` into `out` at `pos` (growing `out` if the bound was short); returns (out, new pos)."""
    n = len(data)
    if pos + n > out.size:  # not reached with the bound above; kept so a wrong bound costs a copy, not data
        grown = np.empty(max(2 * out.size, pos + n), dtype=np.uint8)
        grown[:pos] = out[:pos]
        out = grown
    out[pos : pos + n] = np.frombuffer(data, dtype=np.uint8)
    return out, pos + n


def read_header(blob) -> tuple[dict, int]:
    """Parse and verify a blob's header; returns (header, offset of the first stream)."""
    header, start, _, _ = _read_header(memoryview(blob))
    return header, start


def _read_header(view: memoryview) -> tuple[dict, int, int, int]:
    """(header, offset of the first stream, offset just past the last stream, format version), with the
    header's CRC checked."""
    if len(view) < _PREFIX.size + _FOOTER.size:
        raise CorruptCheckpoint(f"tensor blob truncated: {len(view)} bytes is shorter than a header")
    magic, version = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptCheckpoint(f"not an islands tensor blob (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version not in READS:
        raise CorruptCheckpoint(
            f"tensor blob version {version} is not supported (this build reads "
            f"{' and '.join(map(str, READS))}); it was written by an older islands"
        )
    if version == 3:
        (head_len,) = _V3_HEAD_LEN.unpack_from(view, _PREFIX.size)
        begin = _PREFIX.size + _V3_HEAD_LEN.size
        end = begin + head_len
        if end + _CRC.size > len(view):
            raise CorruptCheckpoint("tensor blob truncated inside its header")
        (crc,) = _CRC.unpack_from(view, end)
        start, stop = end + _CRC.size, len(view)
    else:
        crc, head_len = _FOOTER.unpack_from(view, len(view) - _FOOTER.size)
        end = len(view) - _FOOTER.size
        begin = end - head_len
        if begin < _PREFIX.size:
            raise CorruptCheckpoint("tensor blob truncated: its header length points before its start")
        start, stop = _PREFIX.size, begin
    head = bytes(view[begin:end])
    if zlib.crc32(head) != crc:
        raise CorruptCheckpoint("tensor blob header checksum mismatch (header bytes are damaged)")
    if version >= 6:
        return blob_header.unpack(head, version), start, stop, version
    try:
        header = json.loads(head)
    except ValueError as exc:  # only reachable if the CRC collided
        raise CorruptCheckpoint(f"tensor blob header is not valid JSON: {exc}") from exc
    return header, start, stop, version


def _join_chunk(planes, chunk: dict, decoded: list[np.ndarray], out: np.ndarray, index: int) -> None:
    """Check that a chunk's streams have the shapes its layout needs, then rebuild its bytes."""
    n, odd = divmod(out.size, planes.size)
    if odd:
        raise CorruptCheckpoint(f"chunk {index} holds {out.size} bytes, not whole {planes.size}-byte elements")
    exponent: tuple[np.ndarray, np.ndarray, int] | np.ndarray | None = None
    if "pair_base" in chunk:
        if (
            not hasattr(planes, "shift")
            or len(decoded) < 2
            or decoded[0].size != (n + 1) // 2
            or not 0 <= int(chunk["pair_base"]) <= 255
        ):
            raise CorruptCheckpoint(f"chunk {index}: packed exponents do not fit {n} elements")
        exponent, decoded = (decoded[0], decoded[1], int(chunk["pair_base"])), decoded[2:]
    elif hasattr(planes, "shift"):
        plane = decoded[0] if decoded else None
        if plane is None or plane.size != n:
            raise CorruptCheckpoint(f"chunk {index}: exponent plane does not hold {n} exponents")
        exponent, decoded = plane, decoded[1:]
    if [d.size for d in decoded] not in planes.plane_sizes(n):
        raise CorruptCheckpoint(f"chunk {index} has planes that do not add up to {out.size} bytes")
    try:
        planes.join(exponent, decoded, out)
    except ValueError as exc:
        raise CorruptCheckpoint(f"chunk {index}: {exc}") from exc


def _check_heads(view: memoryview, header: dict, pos: int, stop: int) -> None:
    """Format 6: every frame's first bytes against the header's heads_crc, before any frame is trusted."""
    crc, at = 0, pos
    for chunk in header["chunks"]:  # heads_crc's bytes, without a slice of the whole frame first
        for meta in chunk["streams"]:
            crc = zlib.crc32(view[at : min(at + meta["enc"], stop, at + FRAME_HEAD)], crc)
            at += meta["enc"]
    if crc != header["heads_crc"]:
        raise CorruptCheckpoint(
            f"the stream headers of a {header['dtype']} {tuple(header['shape'])} tensor are "
            f"damaged (their CRC-32 does not match)"
        )


def _check_stored(view: memoryview, chunk: dict, begin: int, end: int, where) -> None:
    """Format 7: a chunk's stored bytes view[begin:end] against its XXH3.

    Checked once the chunk is decoded, before the tensor is returned: the hash then reads bytes the
    decoders just pulled into cache (checked first, it read them from memory for the decoders: 1.1
    against 0.7 ms on an 11.7 M-element fp16 tensor). Decoding damaged bytes first is safe: zstd
    rejects or mis-decodes them without harm, the join loops index nothing by content, and every size
    comes from the CRC-checked header; the output is ours until every chunk has passed."""
    if stored_checksum(view[begin:end]) != chunk["xxh3"]:
        raise CorruptCheckpoint(f"checksum mismatch in {where}: stored bytes are damaged")


def decode_tensor(
    blob: bytes | memoryview, *, base: torch.Tensor | None = None, verify: bool = True, expect_hash: str | None = None
) -> torch.Tensor:
    """Decode a blob from `encode_tensor`. Raises CorruptCheckpoint on any checksum mismatch.

    `base` must be the same tensor the blob was delta-encoded against (checked by content hash).
    `expect_hash`: the content hash the decoded tensor must have, for a blob encoded with
    content_hash=False whose hash is kept elsewhere (the store's manifest); a hash in the blob is checked too.
    `verify=False` skips only that final SHA-256 over the decoded tensor (also skipped when no hash is
    known); every chunk's checksum (every stream's, before format 7) is always checked.
    """
    view = memoryview(blob)
    header, pos, stop, version = _read_header(view)
    return _decode_body(view, header, pos, stop, version, base, verify, expect_hash)


def blob_parts(blob) -> tuple[bytes, memoryview, int]:
    """(binary header, stored streams, format version) of a format 6 or 7 blob, its header CRC checked.

    For containers that keep the headers of many blobs together (safetensors_codec.py's index, under
    one checksum of its own) and the streams apart: `decode_parts(header, streams, version)` decodes
    them again. The 5-byte prefix and 8-byte footer of the blob are what such a container drops."""
    view = memoryview(blob)
    header, pos, stop, version = _read_header(view)
    if version < 6:
        raise ValueError(f"blob_parts needs a binary header (format 6 or 7), this blob is format {version}")
    return bytes(view[stop : len(view) - _FOOTER.size]), view[pos:stop], version


def decode_parts(
    head: bytes, streams, *, version: int = VERSION, expect_hash: str | None = None, verify: bool = True
) -> torch.Tensor:
    """Decode a blob kept as the two parts `blob_parts` gives: its binary header (whose integrity the
    caller vouches for: here it has no CRC of its own) and its streams (checked per chunk by the
    header's XXH3s, as in a whole blob)."""
    if version not in READS or version < 6:
        raise CorruptCheckpoint(f"tensor parts of format {version} cannot be decoded (binary headers are 6 and 7)")
    view = memoryview(streams)
    return _decode_body(
        view, blob_header.unpack(bytes(head), version), 0, len(view), version, None, verify, expect_hash
    )


def _decode_body(
    view: memoryview, header: dict, pos: int, stop: int, version: int, base, verify: bool, expect_hash: str | None
) -> torch.Tensor:
    """The streams of view[pos:stop] decoded as `header` says, every check of decode_tensor included."""
    dtype = dtype_from_name(header["dtype"])
    shape = header["shape"]
    layout, planes = _layout_for(dtype, header["layout"])
    if layout != header["layout"]:
        raise CorruptCheckpoint(f"layout {header['layout']!r} is impossible for dtype {header['dtype']}")
    if version == 6:
        _check_heads(view, header, pos, stop)
    decompressor = coders(TensorCodec.zstd_level).reader(version)
    chunks, name = header["chunks"], header["dtype"]
    out = np.empty(sum(c["bytes"] for c in chunks), dtype=np.uint8)
    filled = 0
    for index, chunk in enumerate(chunks):
        n, streams, begin = chunk["bytes"], chunk["streams"], pos
        target = out[filled : filled + n]
        where = _ChunkName(index, name, shape)
        # A chunk held in one stream (integers, bools, the raw layout) decodes straight into the output.
        direct = planes is None and len(streams) == 1 and streams[0]["raw"] == n
        decoded: list[np.ndarray] = []
        for meta in streams:
            end = pos + meta["enc"]
            if end > stop:
                raise CorruptCheckpoint(f"tensor blob truncated in chunk {index}")
            enc, pos = view[pos:end], end
            decoded.append(
                decode_frame_into(decompressor, enc, meta, target, where)
                if direct
                else decode_frame(decompressor, enc, meta, _SCRATCH_TAGS[len(decoded)], where)
            )
        if planes is not None:
            _join_chunk(planes, chunk, decoded, target, index)
        elif not direct:
            raise CorruptCheckpoint(f"chunk {index} does not hold {n} bytes in one stream")
        if version >= 7:  # after decoding, while the stored bytes are still in cache (see _check_stored)
            _check_stored(view, chunk, begin, pos, where)
        filled += n
    if pos != stop:
        raise CorruptCheckpoint(f"tensor blob has {stop - pos} unexpected bytes after its streams")
    if "delta" in header:
        if base is None:
            raise ValueError("this tensor was delta-encoded: pass the base tensor it was encoded against")
        base_raw = tensor_bytes(base)
        if _content_hash_of(header["dtype"], shape, base_raw) != header["delta"]["base_hash"]:
            raise CorruptCheckpoint("delta base does not match the one this tensor was encoded against")
        np.bitwise_xor(out, base_raw, out=out)  # out is ours: no second tensor-sized array
    if verify and (expect_hash or "content_hash" in header):
        wanted = {h for h in (header.get("content_hash"), expect_hash) if h}
        if wanted != {_content_hash_of(name, shape, out)}:
            raise CorruptCheckpoint(f"decoded {name} {tuple(shape)} tensor does not match its content hash")
    return _tensor_from_bytes(out, dtype, shape)


def _tensor_from_bytes(raw: np.ndarray, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    expected = math.prod(shape) * dtype.itemsize
    if raw.size != expected:
        raise CorruptCheckpoint(f"decoded {raw.size} bytes, but {dtype_name(dtype)} {tuple(shape)} needs {expected}")
    if raw.size == 0:
        return torch.empty(shape, dtype=dtype)
    like = _NUMPY_OF.get(dtype)
    if like is not None:  # numpy's view and reshape cost a tenth of torch's: one torch call, not three
        return torch.from_numpy(raw.view(like).reshape(shape))
    return torch.from_numpy(raw).view(dtype).reshape(shape)


# torch dtypes whose bytes numpy can view as they are (bfloat16 and the float8s it cannot)
_NUMPY_OF = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.float64: np.float64,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.bool: np.bool_,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}
# per stream of a chunk: a chunk has at most 5, but a damaged header may claim up to 255 (a u8)
_SCRATCH_TAGS = tuple(f"decode.{i}" for i in range(256))


class _ChunkName:
    """Where a stream is, for error messages only: formatted when one is raised, not for every stream."""

    __slots__ = ("dtype", "index", "shape")

    def __init__(self, index: int, dtype: str, shape: list[int]):
        self.index, self.dtype, self.shape = index, dtype, shape

    def __str__(self) -> str:
        return f"chunk {self.index} of a {self.dtype} {tuple(self.shape)} tensor"


def warm_kernels() -> None:
    """Compile the codec's numba loops now (cache=True keeps them on disk, next to kernels.py): a round trip of each
    float dtype, plain and against a base, with data whose exponents spread wide enough to escape. A process that
    finds them compiled loads them in ~0.6 CPU-s; one that compiles them takes seconds, and in a fresh checkout many
    processes compile the same loops at once (`make` calls this at setup)."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(4097, generator=g) * torch.logspace(-6, 4, 4097)
        base = x + 1e-3 * torch.randn(4097, generator=g)
        for tensor, against in (
            (x.to(dtype), None),
            (x.to(dtype), base.to(dtype)),
            (torch.zeros(7, dtype=dtype), None),
        ):
            blob = encode_tensor(tensor, base=against)
            decode_tensor(blob, base=against)
