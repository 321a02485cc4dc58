"""Lossless, dtype-aware tensor codec: float exponents split out and entropy-coded (SOTA-437, LIT-750).

In trained floats only the exponent is redundant (LIT-750: ~40 of 256 exponent values occur and the
stream codes to about a third) while sign and mantissa bits look random. layouts.py cuts each float
dtype into byte planes (the 8-bit exponent alone where it is one, packed two codes per byte by
planes.py); then
  exponent streams -> zstd with an LZ stage starved to nothing, which leaves zstd's Huffman literal
                      coder doing the work (as small as level 19, ~100x faster; see docs/checkpointing.md)
  mantissa planes  -> the same coder when bytes sampled across the whole plane have structure (order-0
                      entropy < 7.9 bits), raw zstd blocks otherwise
Huffman-coded streams are cut into zstd blocks of 32-64 KiB (see _PAIR_BLOCK).
Integers, bools, 1-byte floats and anything else go through plain zstd.

Optional XOR delta against a base tensor of the same shape and dtype (SOTA-437: deltas against a base
up to K checkpoints back): unchanged exponent and high mantissa bits become zero bytes.

Integrity: every stream is a zstd frame with an XXH64 content checksum (checked by zstd while decoding,
~10 GB/s); the first bytes of each frame carry a CRC-32 so a flipped header flag cannot switch that
check off; the header carries its own CRC-32; the decoded tensor is checked against a SHA-256 content
hash when one was stored (collision resistant, so the store also dedups on it). The input tensor is
only ever read.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import threading
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from islands.checkpoint.errors import CorruptCheckpoint
from islands.checkpoint.layouts import layout_for
from islands.checkpoint.planes import sampled_entropy_bits, scratch

MAGIC = b"ISLT"
# 3: per-dtype plane layouts (layouts.py); 2: one rotated layout for all floats; 1: raw streams with a
# CRC-32. Only 3 is read: no stored checkpoint outlives a format change in this project yet. (The
# whole-plane mantissa gate and the 32/64 KiB zstd blocks changed only encoder choices: the streams are
# the same zstd frames, so blobs written before and after read alike and the version stays 3.)
VERSION = 3
_FRAME_HEAD = 64  # leading bytes of each frame (frame and first block header) covered by a CRC-32
# Huffman-coded streams are cut into zstd blocks smaller than zstd's own 128 KiB: a fresh code table
# more often follows the statistics from tensor to tensor, and below 80 KiB zstd skips its "looks
# incompressible" shortcut, which samples only a block's first and last 4 KiB (it had stored blocks of
# entropy 5.0 bits raw). Measured on the 22.7 M-element MiniLM bench: exponent pairs -15 KB at 64 KiB
# (-25 KB at 32 KiB, but bf16 decoding 6% slower: a Huffman table to read per block); fp16 high bytes
# -2 KB at 64 KiB (32 KiB: +4 KB); gated mantissa planes -25 KB at 32 KiB against 64 KiB.
_PAIR_BLOCK = 64 << 10  # exponent pairs (128 K elements)
_ELEMENT_BLOCK = 64 << 10  # one byte per element: fp16 high bytes, plain exponent planes
_MANTISSA_BLOCK = 32 << 10  # mantissa planes the gate lets through
# A mantissa plane is Huffman-coded only if 8 K bytes sampled across the whole plane have an order-0
# entropy under 7.9 bits (LIT-750: in trained weights they rarely do; zstd could not keep a gain under
# 1/64 of a block anyway); otherwise it goes into raw zstd blocks at copy speed. Sampling the whole plane
# matters: a chunk often holds the end of one tensor and the start of another (v3 probed the first
# 64 KiB only and stored the fp16-exact pooler and embedding rows raw: +0.27% vs ZipNN on fp32).
_GATE_BITS = 7.9
_GATE_MIN_BYTES = 64 << 10  # smaller planes are always offered to the Huffman coder: cheap, zstd decides
_PREFIX = struct.Struct("<4sBI")  # magic, version, header length
_CRC = struct.Struct("<I")

LAYOUTS = ("split", "zstd", "raw")


def _exponent_params() -> zstandard.ZstdCompressionParameters:
    # Longest minimum match, tiny hash/chain tables, fast strategy: the LZ stage finds almost nothing
    # in a plane of exponents, so the output is Huffman-coded literals (SOTA-437: entropy coder alone).
    return zstandard.ZstdCompressionParameters(
        compression_level=1, strategy=zstandard.STRATEGY_FAST, min_match=7,
        window_log=17, hash_log=6, chain_log=6, search_log=1, write_checksum=True)


def _stored_params() -> zstandard.ZstdCompressionParameters:
    # Fast strategy with a target length set: zstd then skips literal entropy coding and samples for
    # matches sparsely, so an incompressible plane becomes raw blocks plus a checksum at copy speed.
    return zstandard.ZstdCompressionParameters(
        compression_level=1, strategy=zstandard.STRATEGY_FAST, min_match=7,
        window_log=17, hash_log=6, chain_log=6, search_log=1, target_length=1 << 17, write_checksum=True)


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


class _Coders:
    """One thread's zstd objects (they are not thread-safe), reused across calls: a fresh context
    allocates and page-faults its work space on first use, which costs more than a small tensor's coding.

    Every stream is one zstd frame with a content checksum (XXH64, checked by zstd when decoding).
    """

    def __init__(self, level: int):
        self.exponent = zstandard.ZstdCompressor(compression_params=_exponent_params())
        self.stored = zstandard.ZstdCompressor(compression_params=_stored_params())
        self.general = zstandard.ZstdCompressor(level=level, write_checksum=True)
        self.decompressor = zstandard.ZstdDecompressor()


_THREAD_CODERS = threading.local()


def _coders(level: int) -> _Coders:
    cache = getattr(_THREAD_CODERS, "by_level", None)
    if cache is None:
        cache = _THREAD_CODERS.by_level = {}
    if level not in cache:
        cache[level] = _Coders(level)
    return cache[level]


def _blocked(coder, raw: memoryview, block: int) -> bytes:
    """One zstd frame whose blocks hold at most `block` input bytes each (see _PAIR_BLOCK why)."""
    n = len(raw)
    if n <= block:
        return coder.compress(raw)
    obj = coder.compressobj(size=n)
    parts = []
    for b in range(0, n, block):
        parts.append(obj.compress(raw[b:b + block]))
        if b + block < n:
            parts.append(obj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
    parts.append(obj.flush())
    return b"".join(parts)


def _frame(data, coder, method: str, block: int | None = None) -> tuple[dict, bytes]:
    raw = data if isinstance(data, (bytes, memoryview)) else memoryview(data).cast("B")
    enc = coder.compress(raw) if block is None else _blocked(coder, raw, block)
    # zstd checks the frame's content checksum only if the frame header says one is there: the header
    # bytes get their own CRC-32 so that a flipped flag bit cannot switch the check off.
    return {"m": method, "raw": len(raw), "enc": len(enc), "hcrc": zlib.crc32(enc[:_FRAME_HEAD])}, enc


def _mantissa_frame(plane: np.ndarray, coders: _Coders) -> tuple[dict, bytes]:
    """Code a mantissa plane only if a sample across it has structure: in most trained weights it is noise."""
    if plane.size < _GATE_MIN_BYTES or sampled_entropy_bits(plane) < _GATE_BITS:
        return _frame(plane, coders.exponent, "h", _MANTISSA_BLOCK)
    return _frame(plane, coders.stored, "s")


def _split_streams(planes, piece: np.ndarray, coders: _Coders) -> tuple[list, dict]:
    exponent, others = planes.split(piece)
    streams, extra = [], {}
    if isinstance(exponent, tuple):  # packed pairs of 4-bit codes and the escaped exponents
        base, codes, escaped = exponent
        streams += [_frame(codes, coders.exponent, "p", _PAIR_BLOCK), _frame(escaped, coders.exponent, "x")]
        extra = {"pair_base": base}
    elif exponent is not None:  # too many exponents outside any 15-wide window: the plane whole
        streams.append(_frame(exponent, coders.exponent, "h", _ELEMENT_BLOCK))
    for kind, plane in others:
        streams.append(_frame(plane, coders.exponent, "h", _ELEMENT_BLOCK) if kind == "e"
                       else _mantissa_frame(plane, coders))
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
    coders = _coders(codec.zstd_level)
    size = planes.size if planes is not None else 1
    step = max(size, codec.chunk_bytes // size * size)
    chunks, payload = [], []
    for start in range(0, len(raw), step):
        piece = raw[start:start + step]
        meta_extra: dict = {}
        if planes is not None:
            streams, meta_extra = _split_streams(planes, piece, coders)
        elif layout == "zstd":
            streams = [_frame(piece, coders.general, "z")]
        else:
            streams = [_frame(piece, coders.stored, "s")]
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


def _decompress_into(decompressor, frame, buf: np.ndarray) -> tuple[np.ndarray, bool]:
    """Decode one frame into this thread's scratch `buf` (no fresh multi-MB allocation per stream:
    measured 5.1 vs 5.9 ms for a bf16 tensor's 16 MB). Returns (the bytes written, whether the frame
    held more); reading past the end makes zstd check the frame's content checksum."""
    with decompressor.stream_reader(frame) as reader:
        view, got = memoryview(buf), 0
        while got < buf.size:
            step = reader.readinto(view[got:])
            if step == 0:
                break
            got += step
        extra = reader.read(1)
    return buf[:got], bool(extra)


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
    decompressor = _coders(TensorCodec.zstd_level).decompressor
    out = np.empty(sum(c["bytes"] for c in header["chunks"]), dtype=np.uint8)
    filled = 0
    for index, chunk in enumerate(header["chunks"]):
        decoded = []
        for meta in chunk["streams"]:
            enc = view[pos:pos + meta["enc"]]
            pos += meta["enc"]
            if len(enc) != meta["enc"]:
                raise CorruptCheckpoint(f"tensor blob truncated in chunk {index}")
            if zlib.crc32(enc[:_FRAME_HEAD]) != meta["hcrc"]:
                raise CorruptCheckpoint(f"checksum mismatch in a stream header of chunk {index} of a "
                                        f"{header['dtype']} {tuple(shape)} tensor: stored bytes are damaged")
            try:
                data, extra = _decompress_into(decompressor, enc, scratch(f"decode.{len(decoded)}", meta["raw"], np.uint8))
            except zstandard.ZstdError as exc:  # includes the frame's content checksum failing
                raise CorruptCheckpoint(f"chunk {index} of a {header['dtype']} {tuple(shape)} tensor is "
                                        f"damaged: {exc}") from exc
            if extra:
                raise CorruptCheckpoint(f"chunk {index} decoded to more than the {meta['raw']} bytes expected")
            if data.size != meta["raw"]:
                raise CorruptCheckpoint(f"chunk {index} decoded to {data.size} bytes, expected {meta['raw']}")
            decoded.append(data)
        n = chunk["bytes"]
        if planes is not None:
            _join_chunk(planes, chunk, decoded, out[filled:filled + n], index)
        else:
            if len(decoded) != 1 or decoded[0].size != n:
                raise CorruptCheckpoint(f"chunk {index} does not hold {n} bytes in one stream")
            out[filled:filled + n] = decoded[0]
        filled += n
    if pos != len(view):
        raise CorruptCheckpoint(f"tensor blob has {len(view) - pos} unexpected trailing bytes")
    if "delta" in header:
        if base is None:
            raise ValueError("this tensor was delta-encoded: pass the base tensor it was encoded against")
        base_raw = tensor_bytes(base)
        if _content_hash_of(header["dtype"], shape, base_raw) != header["delta"]["base_hash"]:
            raise CorruptCheckpoint("delta base does not match the one this tensor was encoded against")
        out = np.bitwise_xor(out, base_raw)
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
