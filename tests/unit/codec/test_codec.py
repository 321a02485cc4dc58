"""Codec properties: lossless on every dtype and adversarial bit pattern, input untouched, damage detected."""

import re
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from islands.checkpoint.codec.safetensors_codec import compress_file, decompress_file
from islands.checkpoint.codec.tensor import TensorCodec, decode_tensor, encode_tensor, tensor_bytes
from islands.checkpoint.errors import CorruptCheckpoint

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
ALL_DTYPES = FLOATS + [
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
LAYOUTS = ["split", "zstd", "raw"]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(tensor_bytes(a), tensor_bytes(b))


def tensor_from_raw(raw: bytes, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    raw = raw[: len(raw) // size * size]
    return torch.from_numpy(np.frombuffer(bytearray(raw), dtype=np.uint8)).view(dtype)


@settings(max_examples=60, deadline=None)
@given(
    raw=st.binary(min_size=0, max_size=600),
    dtype=st.sampled_from(ALL_DTYPES),
    layout=st.sampled_from(LAYOUTS),
    chunk=st.sampled_from([64, 96, 4 << 20]),
)
def test_any_bit_pattern_round_trips_bitwise(raw, dtype, layout, chunk):
    # Random bytes reinterpreted as the dtype cover NaN payloads, subnormals, infs and -0 in one go.
    t = (
        tensor_from_raw(raw, dtype)
        if dtype != torch.bool
        else torch.from_numpy(np.frombuffer(bytearray(raw), dtype=np.uint8) % 2 == 1)
    )
    before = tensor_bytes(t).copy()
    out = decode_tensor(encode_tensor(t, codec=TensorCodec(layout=layout, chunk_bytes=chunk)))
    assert bits_equal(out, t)
    assert np.array_equal(tensor_bytes(t), before)  # input never mutated


@pytest.mark.parametrize("dtype", FLOATS)
def test_special_values_and_nan_payloads_survive(dtype):
    size = torch.empty((), dtype=dtype).element_size()
    fmt = {2: "<H", 4: "<I", 8: "<Q"}[size]
    exp_all = {2: 0x7F80 if dtype == torch.bfloat16 else 0x7C00, 4: 0x7F800000, 8: 0x7FF0000000000000}[size]
    sign = 1 << (size * 8 - 1)
    patterns = [
        0,
        sign,
        1,
        sign | 1,
        exp_all,
        exp_all | sign,
        exp_all | 1,
        exp_all | 2,
        exp_all | 3 | sign,
        (1 << (size * 8)) - 1,
        exp_all - 1,
    ]
    raw = b"".join(struct.pack(fmt, p) for p in patterns)
    t = tensor_from_raw(raw, dtype)
    assert torch.isnan(t).sum() >= 3 and torch.isinf(t).sum() == 2
    out = decode_tensor(encode_tensor(t))
    assert bits_equal(out, t)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(0,), (3, 0, 2), (), (5, 7)])
def test_every_dtype_and_shape_including_empty_and_scalar(dtype, shape):
    g = torch.Generator().manual_seed(1)
    t = (
        torch.randint(0, 2, shape, generator=g).to(dtype)
        if dtype in (torch.bool,)
        else (torch.randn(shape, generator=g) * 3).to(dtype)
        if dtype.is_floating_point or dtype.is_complex
        else torch.randint(0, 100, shape, generator=g).to(dtype)
    )
    out = decode_tensor(encode_tensor(t))
    assert out.shape == t.shape and bits_equal(out, t)


def test_non_contiguous_input_is_read_in_logical_order_and_untouched():
    base = torch.randn(6, 8)
    view = base.t()[1:, ::2]
    snapshot = base.clone()
    out = decode_tensor(encode_tensor(view))
    assert torch.equal(out, view) and out.is_contiguous()
    assert torch.equal(base, snapshot)


def test_trained_like_weights_shrink_more_than_plain_zstd_for_bf16():
    w = (torch.randn(200_000, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    import zstandard

    ours = len(encode_tensor(w)) / (w.numel() * 2)
    theirs = len(zstandard.ZstdCompressor(level=3).compress(tensor_bytes(w).tobytes())) / (w.numel() * 2)
    assert ours < 0.72 and ours < theirs


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True), max_size=40),
    scale=st.sampled_from([1e-3, 0.02, 1.0, 3e4]),
    n=st.integers(0, 3000),
    dtype=st.sampled_from(FLOATS),
    chunk=st.sampled_from([64, 1000, 4 << 20]),
    seed=st.integers(0, 2**16),
)
def test_weight_like_tensors_with_injected_specials_round_trip(values, scale, n, dtype, chunk, seed):
    # Trained-like values keep the paired-exponent path in use; the injected floats (NaN payloads from
    # hypothesis, subnormals, infinities, -0) land as escapes or force the plain-plane fallback.
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * scale
    if n and values:
        idx = torch.randint(0, n, (len(values),), generator=g)
        w[idx] = torch.tensor(values, dtype=torch.float32)
    t = w.to(dtype)
    before = tensor_bytes(t).copy()
    out = decode_tensor(encode_tensor(t, codec=TensorCodec(chunk_bytes=chunk)))
    assert bits_equal(out, t)
    assert np.array_equal(tensor_bytes(t), before)


@pytest.mark.parametrize("dtype", FLOATS)
def test_every_single_flipped_byte_is_detected(dtype):
    t = (torch.randn(300) * 0.02).to(dtype)
    t[7] = 0.0  # an escaped exponent, so every stream kind is present
    blob = encode_tensor(t, codec=TensorCodec(chunk_bytes=256))
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x10
        with pytest.raises(CorruptCheckpoint):
            decode_tensor(bytes(bad))


def test_truncation_and_trailing_garbage_are_detected():
    blob = encode_tensor(torch.arange(100))
    with pytest.raises(CorruptCheckpoint):
        decode_tensor(blob[:-1])
    with pytest.raises(CorruptCheckpoint):
        decode_tensor(bytes(blob) + b"x")


def test_xor_delta_round_trips_and_checks_the_base():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(1000, generator=g)
    new = base + 1e-4 * torch.randn(1000, generator=g)
    base_copy, new_copy = base.clone(), new.clone()
    blob = encode_tensor(new, base=base)
    assert len(blob) < len(encode_tensor(new))  # shared exponents and high mantissa bits become zeros
    assert torch.equal(decode_tensor(blob, base=base), new)
    assert torch.equal(base, base_copy) and torch.equal(new, new_copy)
    with pytest.raises(ValueError, match="delta-encoded"):
        decode_tensor(blob)
    with pytest.raises(CorruptCheckpoint, match="delta base"):
        decode_tensor(blob, base=base + 1)
    with pytest.raises(ValueError, match="dtype and shape"):
        encode_tensor(new, base=base[:10])


def test_bad_inputs_get_clear_errors():
    with pytest.raises(TypeError, match=re.escape("torch.Tensor")):
        encode_tensor([1, 2, 3])
    with pytest.raises(ValueError, match="layout"):
        TensorCodec(layout="lz4")
    with pytest.raises(CorruptCheckpoint, match="magic"):
        decode_tensor(b"NOPE" + bytes(20))


def test_safetensors_file_round_trips_byte_exactly(tmp_path):
    from safetensors.torch import save_file

    tensors = {
        "w": torch.randn(64, 32) * 0.02,
        "h": (torch.randn(100) * 0.1).half(),
        "b": torch.randn(33).bfloat16(),
        "i": torch.arange(7),
        "m": torch.tensor([True, False]),
        "e": torch.zeros(0, 4),
        "d": torch.randn(5, dtype=torch.float64),
    }
    src, packed, back = tmp_path / "a.safetensors", tmp_path / "a.isc", tmp_path / "b.safetensors"
    save_file(tensors, str(src), metadata={"note": "kept"})
    stats = compress_file(src, packed)
    assert stats["tensors"] == len(tensors) and stats["bytes_out"] == packed.stat().st_size
    decompress_file(packed, back)
    assert back.read_bytes() == src.read_bytes()
    damaged = bytearray(packed.read_bytes())
    damaged[-5] ^= 1
    packed.write_bytes(bytes(damaged))
    with pytest.raises(CorruptCheckpoint):
        decompress_file(packed, tmp_path / "c.safetensors")
