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

MAGIC = b"ISLT"
VERSION = 1
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
# Complex numbers are pairs of floats: code them as their real dtype.
_COMPLEX_AS = {torch.complex64: torch.float32, torch.complex128: torch.float64, torch.complex32: torch.float16}
_UINT_FOR_SIZE = {2: np.uint16, 4: np.uint32, 8: np.uint64}

LAYOUTS = ("split", "zstd", "raw")


def _exponent_params() -> zstandard.ZstdCompressionParameters:
    # Longest minimum match, tiny hash/chain tables, fast strategy: the LZ stage finds almost nothing
    # in a plane of exponents, so the output is Huffman-coded literals (SOTA-437: entropy coder alone).
    return zstandard.ZstdCompressionParameters(
        compression_level=1, strategy=zstandard.STRATEGY_FAST, min_match=7,
        window_log=17, hash_log=6, chain_log=6, search_log=1)


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


def _planes_from_bytes(raw: np.ndarray, size: int) -> list[np.ndarray]:
    """Rotate each element left by one bit, then split into byte planes, most significant first."""
    u = raw.view(_UINT_FOR_SIZE[size])
    bits = size * 8
    rotated = u << np.uint8(1)  # in place after the first op: one temporary, not three
    rotated |= u >> np.uint8(bits - 1)
    # One transposing copy for all planes (1.5x faster than a strided copy per plane on fp32).
    planes = rotated.view(np.uint8).reshape(-1, size).T.copy()
    return [planes[k] for k in range(size - 1, -1, -1)]


def _bytes_from_planes(planes: list[bytes], size: int, count: int) -> np.ndarray:
    columns = np.empty((count, size), dtype=np.uint8)
    for k, plane in zip(range(size - 1, -1, -1), planes):
        columns[:, k] = np.frombuffer(plane, dtype=np.uint8)
    rotated = columns.reshape(-1).view(_UINT_FOR_SIZE[size])
    bits = size * 8
    restored = rotated >> np.uint8(1)
    restored |= rotated << np.uint8(bits - 1)
    return restored.view(np.uint8)


class _Coders:
    """zstd objects are not thread-safe: each encode/decode call builds its own (cheap)."""

    def __init__(self, level: int):
        self.exponent = zstandard.ZstdCompressor(compression_params=_exponent_params())
        self.general = zstandard.ZstdCompressor(level=level)
        self.decompressor = zstandard.ZstdDecompressor()


def _encode_stream(data: bytes | np.ndarray, coder, allow_store: bool) -> tuple[dict, bytes]:
    raw = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    if coder is None:
        enc, method = raw, "s"  # a view: the blob's final join is the only copy
    else:
        enc, method = coder.compress(raw), "z"
        if allow_store and len(enc) >= 0.998 * len(raw):  # no gain: store, decode is then a copy
            enc, method = raw, "s"
    return {"m": method, "raw": len(raw), "enc": len(enc), "crc": zlib.crc32(enc)}, enc


def encode_tensor(tensor: torch.Tensor, *, base: torch.Tensor | None = None,
                  codec: TensorCodec | None = None) -> bytes:
    """Encode one tensor into a self-describing, checksummed blob. `tensor` (and `base`) are only read."""
    codec = codec or TensorCodec()
    raw = tensor_bytes(tensor)
    dtype = dtype_name(tensor.dtype)
    shape = list(tensor.shape)
    header: dict = {"dtype": dtype, "shape": shape, "content_hash": _content_hash_of(dtype, shape, raw)}
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
    chunks, payload = [], []
    stored_before: set[int] = set()
    for index, start in enumerate(range(0, len(raw), step)):
        piece = raw[start:start + step]
        if layout == "split":
            planes = _planes_from_bytes(piece, size)
            # Exponent and mantissa planes share the Huffman-leaning coder; a mantissa plane that did
            # not shrink in the previous chunk is stored without trying again (re-probed every 8th
            # chunk), which halves the coder's work on bf16/fp16 whose low plane is noise.
            probe = index % 8 == 0
            streams = [_encode_stream(p, None if (k in stored_before and not probe) else coders.exponent, True)
                       for k, p in enumerate(planes)]
            stored_before = {k for k, (meta, _) in enumerate(streams) if meta["m"] == "s" and k >= exp_planes}
        elif layout == "zstd":
            streams = [_encode_stream(piece, coders.general, True)]
        else:
            streams = [_encode_stream(piece, None, True)]
        chunks.append({"bytes": len(piece), "streams": [meta for meta, _ in streams]})
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
    `verify=False` skips only the final SHA-256 over the decoded tensor; stream CRCs are always checked.
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
    filled = 0
    for index, chunk in enumerate(header["chunks"]):
        decoded = []
        for meta in chunk["streams"]:
            enc = view[pos:pos + meta["enc"]]
            pos += meta["enc"]
            if len(enc) != meta["enc"]:
                raise CorruptCheckpoint(f"tensor blob truncated in chunk {index}")
            if zlib.crc32(enc) != meta["crc"]:
                raise CorruptCheckpoint(f"checksum mismatch in chunk {index} of a {header['dtype']} "
                                        f"{tuple(shape)} tensor: stored bytes are damaged")
            try:
                data = bytes(enc) if meta["m"] == "s" else decompressor.decompress(enc, max_output_size=meta["raw"])
            except zstandard.ZstdError as exc:
                raise CorruptCheckpoint(f"chunk {index} does not decompress: {exc}") from exc
            if len(data) != meta["raw"]:
                raise CorruptCheckpoint(f"chunk {index} decoded to {len(data)} bytes, expected {meta['raw']}")
            decoded.append(data)
        n = chunk["bytes"]
        if layout == "split":
            out[filled:filled + n] = _bytes_from_planes(decoded, size, n // size)
        else:
            out[filled:filled + n] = np.frombuffer(decoded[0], dtype=np.uint8)
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
    if verify and _content_hash_of(header["dtype"], shape, out) != header["content_hash"]:
        raise CorruptCheckpoint(f"decoded {header['dtype']} {tuple(shape)} tensor does not match its content hash")
    return _tensor_from_bytes(out, dtype, shape)


def _tensor_from_bytes(raw: np.ndarray, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    expected = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    if raw.size != expected:
        raise CorruptCheckpoint(f"decoded {raw.size} bytes, but {dtype_name(dtype)} {tuple(shape)} needs {expected}")
    if raw.size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(shape)
