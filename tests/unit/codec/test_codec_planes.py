"""Codec v3 internals that the property tests reach only by chance: exponent pair packing with escapes,
the per-dtype plane layouts, the content-hash options, per-thread scratch buffers, frame-header damage."""

import threading

import numpy as np
import pytest
import torch

from islands.checkpoint.codec import kernels
from islands.checkpoint.codec.layouts import layout_for
from islands.checkpoint.codec.planes import ESCAPE, pack_exponents, unpack_exponents
from islands.checkpoint.codec.tensor import (
    TensorCodec,
    content_hash,
    decode_tensor,
    encode_tensor,
    read_header,
    tensor_bytes,
)
from islands.checkpoint.errors import CorruptCheckpoint


def weights_with_outliers(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * 0.02
    w[::397] = 0.0  # exponent 0: far outside the common window, so it must escape
    w[5::301] = 3e4  # huge exponents escape too
    w[7::503] = float("inf")
    return w.to(dtype)


@pytest.mark.parametrize("n", [2, 3, 17, 1000, 1001])
def test_pair_packing_round_trips_with_escapes_and_odd_counts(n):
    rng = np.random.default_rng(n)
    x = (rng.integers(118, 126, n) if n > 3 else rng.integers(0, 256, n)).astype(np.uint8)
    x[:: max(1, n // 7)] = rng.integers(0, 256, len(x[:: max(1, n // 7)]))
    packed = pack_exponents(x)
    if packed is None:  # too many escapes for a tiny plane: the plain plane is used instead
        assert n <= 17
        return
    base, codes, escaped = packed
    assert codes.size == (n + 1) // 2
    back = unpack_exponents(codes.copy(), escaped.copy(), base, n)
    assert np.array_equal(back, x)
    assert escaped.size == int(((x - np.uint8(base)) >= ESCAPE).sum())
    # The compiled split writes exactly these bytes for words holding these exponents (bf16: bits 7-14,
    # fp32: bits 23-30), with the other bits random, and the compiled join puts every word back.
    for dtype, word, shift in ((torch.bfloat16, np.uint16, 7), (torch.float32, np.uint32, 23)):
        noise = rng.integers(0, 1 << (8 * np.dtype(word).itemsize), n, dtype=np.uint64).astype(word)
        words = (noise & word(~(0xFF << shift) & ((1 << (8 * np.dtype(word).itemsize)) - 1))) | (
            x.astype(word) << word(shift)
        )
        layout = layout_for(dtype)
        exponent, planes = layout.split(words.view(np.uint8))
        assert isinstance(exponent, tuple)
        assert exponent[0] == base and np.array_equal(exponent[1], codes) and np.array_equal(exponent[2], escaped)
        out = np.empty(words.nbytes, np.uint8)
        layout.join((exponent[1].copy(), exponent[2].copy(), base), [p.copy() for _, p in planes], out)
        assert np.array_equal(out.view(word), words)


def test_pair_packing_refuses_noise_and_detects_mismatched_streams():
    noise = np.random.default_rng(0).integers(0, 256, 4096).astype(np.uint8)
    assert pack_exponents(noise) is None
    x = np.full(100, 120, np.uint8)
    x[3] = 0
    base, codes, escaped = pack_exponents(x)
    codes = codes.copy()
    with pytest.raises(ValueError, match="escape"):
        unpack_exponents(codes, escaped[:0], base, 100)
    with pytest.raises(ValueError, match="packed bytes"):
        unpack_exponents(codes[:-1], escaped, base, 100)


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 31, 33, 4097])
def test_compiled_escape_scans_match_a_plain_scan(n):
    rng = np.random.default_rng(n)
    codes = rng.integers(0, 16, n).astype(np.uint8)
    padded = np.append(codes, 0) if n % 2 else codes
    packed = (padded[0::2] | (padded[1::2] << 4)).astype(np.uint8)
    where = np.flatnonzero(codes == ESCAPE)
    words = rng.integers(0, 1 << 16, n, dtype=np.int64).astype(np.uint16)
    escaped = np.empty(n, np.uint8)
    assert kernels.collect_escapes(packed, n, words, 7, escaped) == where.size
    assert np.array_equal(escaped[: where.size], (words[where] >> 7) & 0xFF)
    if where.size:  # one slot short: the collector gives up instead of writing past it
        assert kernels.collect_escapes(packed, n, words, 7, escaped[: where.size - 1]) == -1
    out = np.zeros(n, np.uint16)
    new = rng.integers(0, 256, where.size).astype(np.uint8)
    assert kernels.patch_escapes(packed, n, new, out, 7) == where.size
    expect = np.zeros(n, np.uint16)
    expect[where] = new.astype(np.uint16) << 7
    assert np.array_equal(out, expect)
    # a damaged stream with fewer escaped exponents than codes 15 is counted, never read past
    assert kernels.patch_escapes(packed, n, new[:0], out, 7) == where.size


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.float64])
def test_each_layout_splits_and_joins_every_bit_pattern(dtype):
    # Every 16-bit pattern once (bf16/fp16), or random words: all signs, exponents, NaN payloads.
    size = torch.empty((), dtype=dtype).element_size()
    rng = np.random.default_rng(size)
    raw = (
        np.arange(1 << 16, dtype=np.uint16).view(np.uint8)
        if size == 2
        else rng.integers(0, 256, 50_000 * size, dtype=np.uint8)
    )
    layout = layout_for(dtype)
    exponent, planes = layout.split(raw)
    if isinstance(exponent, tuple):  # pair-packed: copy out of scratch, as the codec does via zstd
        exponent = (exponent[1].copy(), exponent[2].copy(), exponent[0])
    elif exponent is not None:
        exponent = exponent.copy()
    planes = [p.copy() for _, p in planes]
    out = np.empty_like(raw)
    layout.join(exponent, planes, out)
    assert np.array_equal(out, raw)


def test_float_layouts_code_what_they_promise():
    # bf16/fp32: the exponent plane is paired; fp16: the high byte is entropy-coded, the low byte probed.
    w = weights_with_outliers(100_000, torch.float32)
    kinds = {}
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        header, _ = read_header(encode_tensor(w.to(dtype)))
        kinds[dtype] = [s["m"] for s in header["chunks"][0]["streams"]]
    assert kinds[torch.bfloat16][:2] == ["p", "x"] and len(kinds[torch.bfloat16]) == 3
    assert kinds[torch.float32][:2] == ["p", "x"] and len(kinds[torch.float32]) == 5
    assert kinds[torch.float16][0] == "h" and len(kinds[torch.float16]) == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.complex64])
def test_weights_with_zeros_infs_and_outliers_round_trip_through_pairs(dtype):
    w = weights_with_outliers(50_001, torch.float32)
    t = torch.complex(w, w.flip(0)) if dtype == torch.complex64 else w.to(dtype)
    blob = encode_tensor(t, codec=TensorCodec(chunk_bytes=64 << 10))
    header, _ = read_header(blob)
    assert all("pair_base" in c for c in header["chunks"])  # the paired path really ran
    assert any(s["m"] == "x" and s["raw"] > 0 for c in header["chunks"] for s in c["streams"])
    assert np.array_equal(tensor_bytes(decode_tensor(blob)), tensor_bytes(t))


def test_content_hash_options():
    t = weights_with_outliers(3000, torch.bfloat16)
    digest = content_hash(t)
    computed = encode_tensor(t)
    given = encode_tensor(t, content_hash=digest)
    assert computed == given  # a hash passed in is exactly the one the codec would compute
    bare = encode_tensor(t, content_hash=False)
    assert "content_hash" not in read_header(bare)[0]
    assert torch.equal(decode_tensor(bare).view(torch.int16), t.view(torch.int16))
    wrong = encode_tensor(t, content_hash="0" * 64)
    with pytest.raises(CorruptCheckpoint, match="content hash"):
        decode_tensor(wrong)
    with pytest.raises(TypeError, match="content_hash"):
        encode_tensor(t, content_hash=1)


def test_threads_encoding_at_once_do_not_share_scratch():
    tensors = [
        weights_with_outliers(200_000, dtype, seed=i)
        for i, dtype in enumerate([torch.bfloat16, torch.float32, torch.float16, torch.bfloat16])
    ]
    results: dict[int, bytes] = {}

    def work(i):
        for _ in range(3):
            results[i] = encode_tensor(tensors[i], codec=TensorCodec(chunk_bytes=128 << 10))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(tensors))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    for i, t in enumerate(tensors):
        assert results[i] == encode_tensor(t, codec=TensorCodec(chunk_bytes=128 << 10))
        assert np.array_equal(tensor_bytes(decode_tensor(results[i])), tensor_bytes(t))


def test_a_flipped_frame_flag_is_caught_by_the_header_crc():
    t = weights_with_outliers(5000, torch.float16)
    blob = bytearray(encode_tensor(t))
    _, pos = read_header(bytes(blob))
    blob[pos + 4] ^= 0x04  # zstd frame descriptor: the content-checksum flag
    with pytest.raises(CorruptCheckpoint):
        decode_tensor(bytes(blob))
