"""Blob format v7 (streams, then a binary header as a footer, one XXH3 per chunk of stored bytes):
layout, what the returned view supports, the versions still read and the ones refused, and the output
buffer growing when its bound is short."""

import io
import struct
import zlib

import numpy as np
import pytest
import torch
import xxhash

from harness.legacy_blobs import as_version
from islands.checkpoint.codec import blob_header, tensor as codec
from islands.checkpoint.codec.tensor import decode_tensor, encode_tensor, read_header, tensor_bytes
from islands.checkpoint.errors import CorruptCheckpoint


def _weights(n=50_000, dtype=torch.bfloat16):
    return (torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)


def test_v7_blob_is_magic_version_streams_binary_header_crc_length():
    t = _weights()
    blob = encode_tensor(t)
    raw = bytes(blob)
    assert raw[:5] == b"ISLT\x07"
    crc, head_len = struct.unpack_from("<II", raw, len(raw) - 8)
    head = raw[len(raw) - 8 - head_len : len(raw) - 8]
    assert zlib.crc32(head) == crc
    header = blob_header.unpack(head)
    assert header == read_header(blob)[0] and read_header(blob)[1] == 5
    assert blob_header.pack(header) == head
    assert sum(s["enc"] for c in header["chunks"] for s in c["streams"]) == len(raw) - 5 - 8 - head_len
    # one chunk of three streams and a SHA-256: the JSON of formats 3-5 took ~340 bytes for the same
    assert head_len < 32 + 40


@pytest.mark.parametrize(
    "header",
    [
        {"dtype": "bfloat16", "shape": [], "layout": "split", "chunks": []},
        {
            "dtype": "my_float",
            "shape": [0, 3, 1 << 40],
            "layout": "raw",
            "content_hash": "ab" * 32,
            "delta": {"base_hash": "cd" * 32},
            "chunks": [
                {"bytes": 1 << 33, "pair_base": 0, "streams": [{"m": "p", "raw": 5, "enc": 300}], "xxh3": 1 << 63},
                {"bytes": 7, "streams": [{"m": "r", "raw": 7, "enc": 7}], "xxh3": 0},
            ],
        },
    ],
)
def test_binary_header_round_trips_every_field(header):
    assert blob_header.unpack(blob_header.pack(header)) == header


def test_v6_binary_header_round_trips_its_own_checksum_fields():
    header = {
        "dtype": "float16",
        "shape": [3],
        "layout": "split",
        "heads_crc": 0xFFFFFFFF,
        "chunks": [
            {
                "bytes": 6,
                "streams": [{"m": "h", "raw": 3, "enc": 12}, {"m": "r", "raw": 3, "enc": 3, "xxh": (1 << 64) - 1}],
            }
        ],
    }
    assert blob_header.unpack(blob_header.pack(header, version=6), version=6) == header
    with pytest.raises(ValueError, match="formats 6 and 7"):
        blob_header.pack(header, version=5)


def test_binary_header_damage_is_named():
    head = blob_header.pack(
        {
            "dtype": "float16",
            "shape": [4],
            "layout": "split",
            "chunks": [{"bytes": 8, "streams": [{"m": "h", "raw": 4, "enc": 9}], "xxh3": 1}],
        }
    )
    with pytest.raises(CorruptCheckpoint, match="ends early"):
        blob_header.unpack(head[:-1])
    with pytest.raises(CorruptCheckpoint, match="after its last field"):
        blob_header.unpack(head + b"\x00")
    with pytest.raises(CorruptCheckpoint, match="dtype code"):
        blob_header.unpack(bytes([200]) + head[1:])
    with pytest.raises(CorruptCheckpoint, match="layout code"):
        blob_header.unpack(head[:1] + bytes([9]) + head[2:])
    with pytest.raises(CorruptCheckpoint, match="64 bits"):
        blob_header.unpack(head[:3] + b"\xff" * 11)


def test_each_chunk_carries_the_xxh3_of_its_stored_bytes():
    t = _weights(60_000, torch.float16)
    blob = encode_tensor(t, codec=codec.TensorCodec(chunk_bytes=32 << 10), content_hash=False)
    header, at = read_header(blob)
    assert len(header["chunks"]) == 4
    for chunk in header["chunks"]:
        end = at + sum(s["enc"] for s in chunk["streams"])
        assert chunk["xxh3"] == xxhash.xxh3_64_intdigest(blob[at:end])
        at = end


@pytest.mark.parametrize("where", ["frame header", "frame body", "raw plane", "last byte"])
def test_a_flipped_bit_in_any_stored_byte_is_caught(where):
    # zstd ignores the frame header's unused bit, so only a checksum of the stored bytes can see it;
    # elsewhere zstd may refuse the frame first. Either way the error names the chunk.
    blob = encode_tensor(_weights(200_000), content_hash=False)
    header, start = read_header(blob)
    streams = header["chunks"][0]["streams"]
    assert streams[-1]["m"] == "r"
    stored = sum(s["enc"] for s in streams)
    at = {
        "frame header": start,
        "frame body": start + 100,
        "raw plane": start + stored - 5_000,
        "last byte": start + stored - 1,
    }[where]
    bad = bytearray(blob)
    bad[at] ^= 0x10
    match = "checksum mismatch in chunk 0 of a bfloat16" if where != "frame body" else "chunk 0 of a bfloat16"
    with pytest.raises(CorruptCheckpoint, match=match):
        decode_tensor(bytes(bad))


def test_the_blob_is_a_read_only_bytes_like_view():
    t = _weights()
    blob = encode_tensor(t)
    assert isinstance(blob, memoryview) and blob.readonly and blob.format == "B"
    assert blob == bytes(blob) and len(blob) == len(bytes(blob))
    assert zlib.crc32(blob) == zlib.crc32(bytes(blob))
    f = io.BytesIO()
    f.write(blob)
    assert f.getvalue() == bytes(blob) and b"".join([b"x", blob]) == b"x" + bytes(blob)
    with pytest.raises(TypeError):
        blob[0] = 1
    assert torch.equal(decode_tensor(bytearray(blob)).view(torch.int16), t.view(torch.int16))


def _fp32_weights(n: int) -> torch.Tensor:
    """fp32 weights whose low mantissa bytes are noise (torch.randn's float32 low byte is not)."""
    return torch.from_numpy(np.random.default_rng(0).standard_normal(n) * 0.02).float()


def _plane_sizes(blob) -> list[list[int]]:
    return [[s["raw"] for s in c["streams"][2:]] for c in read_header(blob)[0]["chunks"]]


def test_fp32_noise_low_half_travels_as_one_stored_word_plane():
    n = 300_000
    t = _fp32_weights(n)
    blob = encode_tensor(t)
    assert _plane_sizes(blob) == [[n, 2 * n]]
    assert [s["m"] for s in read_header(blob)[0]["chunks"][0]["streams"][2:]] == ["r", "r"]  # stored raw
    assert np.array_equal(tensor_bytes(decode_tensor(blob)), tensor_bytes(t))


def test_fp32_with_structured_low_bytes_keeps_three_byte_planes_and_codes_them():
    n = 300_000
    t = _fp32_weights(n).to(torch.float16).to(torch.float32)  # fp16-exact: the low 13 bits are 0
    blob = encode_tensor(t)
    assert _plane_sizes(blob) == [[n, n, n]]
    assert len(blob) < 2.2 * n  # the zero low byte and the 3-bit byte are coded, not stored (4 n raw)
    assert np.array_equal(tensor_bytes(decode_tensor(blob)), tensor_bytes(t))


def test_v4_fp32_blobs_with_three_byte_planes_still_decode(monkeypatch):
    from islands.checkpoint.codec.layouts import Fp32Layout, _ExponentWords

    t = _fp32_weights(300_000)
    monkeypatch.setattr(Fp32Layout, "_new_planes", _ExponentWords._new_planes)  # what v4 wrote
    blob = encode_tensor(t)
    monkeypatch.undo()
    assert _plane_sizes(blob) == [[300_000] * 3]
    assert np.array_equal(tensor_bytes(decode_tensor(as_version(blob, 4))), tensor_bytes(t))


@pytest.mark.parametrize("version", [4, 5])
def test_v4_and_v5_blobs_still_decode_and_their_stream_header_crcs_are_checked(version):
    t = _weights(20_000)
    old = as_version(encode_tensor(t), version)
    assert np.array_equal(tensor_bytes(decode_tensor(old)), tensor_bytes(t))
    bad = bytearray(old)
    bad[5 + 4] ^= 0x10  # the first frame's unused header bit, behind its magic: only its hcrc sees it
    with pytest.raises(CorruptCheckpoint, match="stream header"):
        decode_tensor(bytes(bad))


def test_a_word_plane_of_the_wrong_size_is_refused():
    t = _fp32_weights(300_000)
    other = encode_tensor(t[:150_000])  # same layout, fewer elements: swap in its second header
    assert _plane_sizes(other) == [[150_000, 300_000]]
    mixed = bytes(other)
    h2, start2 = read_header(mixed)
    h2["chunks"][0]["bytes"] = 800_000  # claims 200 K elements: the word plane holds 150 K
    head = blob_header.pack(h2)
    streams = mixed[start2 : len(mixed) - 8 - struct.unpack_from("<II", mixed, len(mixed) - 8)[1]]
    with pytest.raises(CorruptCheckpoint):
        decode_tensor(mixed[:start2] + streams + head + struct.pack("<II", zlib.crc32(head), len(head)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int64])
def test_v3_blobs_still_decode_and_v3_damage_is_still_caught(dtype):
    t = _weights(20_000, torch.float32).mul(1000).to(dtype)
    old = as_version(encode_tensor(t, codec=codec.TensorCodec(chunk_bytes=16 << 10)), 3)
    assert np.array_equal(tensor_bytes(decode_tensor(old)), tensor_bytes(t))
    for i in (5, 12, len(old) // 2, len(old) - 1):
        bad = bytearray(old)
        bad[i] ^= 0x20
        with pytest.raises(CorruptCheckpoint):
            decode_tensor(bytes(bad))


def test_v6_blobs_still_decode_and_their_checksums_are_checked():
    for t in (_weights(200_000), _weights(20_000, torch.float16), _fp32_weights(300_000)):
        old = as_version(encode_tensor(t), 6)
        assert old[:5] == b"ISLT\x06"
        assert np.array_equal(tensor_bytes(decode_tensor(old)), tensor_bytes(t))
    header, start = read_header(old)
    assert [s["m"] for s in header["chunks"][0]["streams"]][-2:] == ["r", "r"] and "heads_crc" in header
    raw_at = start + sum(s["enc"] for s in header["chunks"][0]["streams"][:-1]) + 1000
    for at, message in ((start, "stream headers"), (start + 300, "is damaged"), (raw_at, "raw plane")):
        bad = bytearray(old)
        bad[at] ^= 0x10  # the first frame's unused header bit; inside its Huffman code; inside a raw plane
        with pytest.raises(CorruptCheckpoint, match=message):
            decode_tensor(bytes(bad))


@pytest.mark.parametrize("version", [1, 2, 8])
def test_other_versions_are_refused_by_name(version):
    bad = bytearray(encode_tensor(_weights(100)))
    bad[4] = version
    with pytest.raises(CorruptCheckpoint, match=f"version {version} is not supported"):
        decode_tensor(bytes(bad))


def test_a_header_length_pointing_before_the_streams_is_refused():
    raw = bytearray(encode_tensor(_weights(1000)))
    struct.pack_into("<I", raw, len(raw) - 4, len(raw))
    with pytest.raises(CorruptCheckpoint, match="header length"):
        decode_tensor(bytes(raw))


def test_output_buffer_grows_when_its_bound_is_short():
    out = np.zeros(4, np.uint8)
    out[:3] = [1, 2, 3]
    out, pos = codec._put(out, 3, b"abcdef")
    assert pos == 9 and bytes(out[:pos]) == b"\x01\x02\x03abcdef"


def test_an_empty_stream_is_no_frame_and_a_missing_frame_is_refused():
    t = (torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    blob = encode_tensor(t, content_hash=False)
    header, start = read_header(blob)
    escapes = header["chunks"][0]["streams"][1]
    assert escapes["m"] == "x" and escapes["raw"] == 0 and escapes["enc"] == 0  # no exponent escaped
    assert torch.equal(decode_tensor(blob).view(torch.int16), t.view(torch.int16))
    raw = bytes(blob)
    crc, head_len = struct.unpack_from("<II", raw, len(raw) - 8)
    escapes["raw"] = 4  # claims four escaped exponents, with no frame to hold them
    head = blob_header.pack(header)
    bad = raw[: len(raw) - 8 - head_len] + head + struct.pack("<II", zlib.crc32(head), len(head))
    with pytest.raises(CorruptCheckpoint, match="has none"):
        decode_tensor(bad)


def test_a_raw_plane_is_read_in_place_and_a_flipped_byte_in_it_is_caught():
    t = _weights(200_000)  # its sign|mantissa plane is noise and large enough to be stored raw
    blob = encode_tensor(t, content_hash=False)
    header, start = read_header(blob)
    metas = header["chunks"][0]["streams"]
    assert metas[-1]["m"] == "r" and metas[-1]["raw"] == metas[-1]["enc"] == 200_000
    at = start + sum(m["enc"] for m in metas[:-1]) + 12_345  # inside the raw plane
    bad = bytearray(blob)
    bad[at] ^= 0x01
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch in chunk 0"):
        decode_tensor(bytes(bad))
    assert torch.equal(decode_tensor(blob).view(torch.int16), t.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_the_raw_layout_stores_chunks_as_raw_streams(dtype):
    t = (torch.randn(70_000, generator=torch.Generator().manual_seed(2)) * 100).to(dtype)
    blob = encode_tensor(t, codec=codec.TensorCodec(layout="raw", chunk_bytes=64 << 10), content_hash=False)
    header, _ = read_header(blob)
    n = t.numel() * t.element_size()
    assert [s["m"] for c in header["chunks"] for s in c["streams"]] == ["r"] * -(-n // (64 << 10))
    assert len(blob) < n + 64 + 24 * len(header["chunks"])  # the bytes, each chunk's sizes and XXH3
    assert np.array_equal(tensor_bytes(decode_tensor(blob)), tensor_bytes(t))
