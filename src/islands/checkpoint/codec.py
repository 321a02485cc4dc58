"""Lossless, dtype-aware tensor codec: float exponents split out and entropy-coded (SOTA-437, LIT-750).

In trained floats only the exponent is redundant (LIT-750: ~40 of 256 exponent values occur and the
stream codes to about a third) while sign and mantissa bits look random. So each float element is
rotated left by one bit, which puts the sign next to the mantissa and lines the exponent up on a byte
boundary (bf16 `seeeeeeeemmmmmmm` -> `eeeeeeeemmmmmmms`), then cut into byte planes:
  exponent plane(s)  -> zstd with an LZ stage starved to nothing, which leaves zstd's Huffman literal
                        coder doing the work (as small as level 19, ~100x faster; see docs/checkpointing.md)
  mantissa planes    -> the same coder, stored raw when it does not gain at least 0.2%
Integers, bools, 1-byte floats and anything else go through plain zstd.

Optional XOR delta against a base tensor of the same shape and dtype (SOTA-437: deltas against a base
up to K checkpoints back): unchanged exponent and high mantissa bits become zero bytes.

Integrity: every stored stream carries a CRC-32 (detects any burst of <= 32 bits, so any single
damaged byte, at ~2 GB/s); the header carries its own CRC-32; the decoded tensor is checked against a
SHA-256 content hash (collision resistant, so the store can also dedup on it; SHA-256 beats blake2b here
at ~1.5 GB/s thanks to CPU SHA extensions). The input tensor is only ever read.
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
import zstandard

from islands.checkpoint.errors import CorruptCheckpoint
from islands.checkpoint.planes import pack_exponents, plane_buffers, unpack_exponents

MAGIC = b"ISLT"
VERSION = 2  # 2: every stream is a zstd frame with a content checksum (1: raw streams with a CRC-32)
_FRAME_HEAD = 64  # leading bytes of each frame (frame and first block header) covered by a CRC-32
# A mantissa plane is entropy-coded only if its first 64 KiB shrink by at least 1% (LIT-750: they
# rarely do in trained weights; the rest is stored in raw zstd blocks, which costs a copy).
_PROBE_BYTES = 64 << 10
_PROBE_GAIN = 0.99
_PREFIX = struct.Struct("<4sBI")  # magic, version, header length
_CRC = struct.Struct("<I")

# Float dtypes -> (element bytes, how many top byte planes hold exponent bits after the rotation).
# fp64's 11-bit exponent spans the top byte and 3 bits of the next, so both go to the entropy coder.
_FLOAT_LAYOUT = {
    torch.bfloat16: (2, 1),
    torch.float16: (2, 1),  # 5-bit exponent + 3 mantissa bits share the top byte
    torch.float32: (4, 1),
    torch.float64: (8, 2),
}
# Where the top plane is exactly the 8-bit exponent, exponents are packed two to a byte (planes.py).
_PAIRED_EXPONENT = {torch.bfloat16, torch.float32}
# Complex numbers are pairs of floats: code them as their real dtype.
_COMPLEX_AS = {torch.complex64: torch.float32, torch.complex128: torch.float64, torch.complex32: torch.float16}

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


def _layout_for(dtype: torch.dtype, requested: str) -> tuple[str, int, int]:
    """(layout, element bytes, exponent planes) actually used for this dtype."""
    if requested != "split":
        return requested, 0, 0
    real = _COMPLEX_AS.get(dtype, dtype)
    if real in _FLOAT_LAYOUT:
        size, exp_planes = _FLOAT_LAYOUT[real]
        return "split", size, exp_planes
    return "zstd", 0, 0


class _Coders:
    """zstd objects are not thread-safe: each encode/decode call builds its own (cheap).

    Every stream is one zstd frame with a content checksum (XXH64, checked by zstd when decoding).
    """

    def __init__(self, level: int):
        self.exponent = zstandard.ZstdCompressor(compression_params=_exponent_params())
        self.stored = zstandard.ZstdCompressor(compression_params=_stored_params())
        self.general = zstandard.ZstdCompressor(level=level, write_checksum=True)


def _frame(data, coder, method: str) -> tuple[dict, bytes]:
    raw = data if isinstance(data, (bytes, memoryview)) else memoryview(data).cast("B")
    enc = coder.compress(raw)
    # zstd checks the frame's content checksum only if the frame header says one is there: the header
    # bytes get their own CRC-32 so that a flipped flag bit cannot switch the check off.
    return {"m": method, "raw": len(raw), "enc": len(enc), "hcrc": zlib.crc32(enc[:_FRAME_HEAD])}, enc


def _mantissa_frame(plane: np.ndarray, coders: _Coders) -> tuple[dict, bytes]:
    """Code a mantissa plane only if a sample of it shrinks: in most trained weights it is noise."""
    sample = plane[:_PROBE_BYTES]
    if len(coders.exponent.compress(sample)) < _PROBE_GAIN * len(sample):
        return _frame(plane, coders.exponent, "h")
    return _frame(plane, coders.stored, "s")


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
    layout, size, exp_planes = _layout_for(tensor.dtype, codec.layout)
    header["layout"] = layout
    coders = _Coders(codec.zstd_level)
    step = max(size, (codec.chunk_bytes // max(size, 1)) * max(size, 1))
    buffers = plane_buffers(size, min(step, len(raw)) // size) if layout == "split" and len(raw) else None
    chunks, payload = [], []
    paired = _COMPLEX_AS.get(tensor.dtype, tensor.dtype) in _PAIRED_EXPONENT
    for start in range(0, len(raw), step):
        piece = raw[start:start + step]
        meta_extra: dict = {}
        if buffers is not None:
            planes = buffers.split(piece)
            packed = pack_exponents(planes[0], buffers) if paired else None
            streams = [_frame(p, coders.exponent, "h") if k < exp_planes else _mantissa_frame(p, coders)
                       for k, p in enumerate(planes[1:] if packed else planes, start=int(bool(packed)))]
            if packed:
                base_code, codes, escaped = packed
                streams[:0] = [_frame(codes, coders.exponent, "p"), _frame(escaped, coders.exponent, "x")]
                meta_extra = {"pair_base": base_code}
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
    layout, size, _ = _layout_for(dtype, header["layout"])
    if layout != header["layout"]:
        raise CorruptCheckpoint(f"layout {header['layout']!r} is impossible for dtype {header['dtype']}")
    decompressor = zstandard.ZstdDecompressor()
    out = np.empty(sum(c["bytes"] for c in header["chunks"]), dtype=np.uint8)
    buffers = None
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
                data = decompressor.decompress(enc, max_output_size=meta["raw"])
            except zstandard.ZstdError as exc:  # includes the frame's content checksum failing
                raise CorruptCheckpoint(f"chunk {index} of a {header['dtype']} {tuple(shape)} tensor is "
                                        f"damaged: {exc}") from exc
            if len(data) != meta["raw"]:
                raise CorruptCheckpoint(f"chunk {index} decoded to {len(data)} bytes, expected {meta['raw']}")
            decoded.append(np.frombuffer(data, dtype=np.uint8))
        n = chunk["bytes"]
        if layout == "split":
            if "pair_base" in chunk:
                try:
                    exponents = unpack_exponents(decoded[0], decoded[1], int(chunk["pair_base"]), n // size)
                except ValueError as exc:
                    raise CorruptCheckpoint(f"chunk {index}: {exc}") from exc
                decoded[:2] = [exponents]
            if len(decoded) != size or any(d.size * size != n for d in decoded):
                raise CorruptCheckpoint(f"chunk {index} has planes that do not add up to {n} bytes")
            buffers = buffers or plane_buffers(size)
            buffers.join(decoded, out[filled:filled + n])
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
