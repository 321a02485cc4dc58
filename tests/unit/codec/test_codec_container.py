"""The compressed safetensors container (`islands ckpt compress`, safetensors_codec.py): format 2 round
trips, what it detects, its size per tensor, and format 1 files still loading."""

import hashlib
import json
import struct

import pytest
import torch
import zstandard
from safetensors.torch import save_file

from harness.legacy_containers import V1_FILE, V1_SOURCE_SHA256, v1_source, write_v1
from islands.checkpoint.codec import blob_header
from islands.checkpoint.codec.safetensors_codec import _Reader, compress_file, decompress_file
from islands.checkpoint.codec.tensor import blob_parts, decode_parts, encode_tensor
from islands.checkpoint.errors import CorruptCheckpoint


def _trained_like(n_layers: int = 6, d: int = 48, seed: int = 0) -> dict[str, torch.Tensor]:
    """A transformer-shaped state: per layer 16 tensors (4 attention matrices and biases, 2 FFN
    matrices and biases, 2 LayerNorms), embeddings and a pooler, 103 tensors for 6 layers like MiniLM,
    most of them small. Values with trained weights' spread: LayerNorm weights near 1, biases small."""
    g = torch.Generator().manual_seed(seed)
    out = {
        "embeddings.position_ids": torch.arange(128).reshape(1, 128),
        "embeddings.word_embeddings.weight": torch.randn(500, d, generator=g) * 0.05,
        "embeddings.position_embeddings.weight": torch.randn(128, d, generator=g) * 0.02,
        "embeddings.token_type_embeddings.weight": torch.randn(2, d, generator=g) * 0.02,
        "embeddings.LayerNorm.weight": 1 + torch.randn(d, generator=g) * 0.05,
        "embeddings.LayerNorm.bias": torch.randn(d, generator=g) * 0.01,
    }
    for i in range(n_layers):
        p = f"encoder.layer.{i}."
        for m in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            out[p + m + ".weight"] = torch.randn(d, d, generator=g) * d**-0.5
            out[p + m + ".bias"] = torch.randn(d, generator=g) * 0.02
        out[p + "intermediate.dense.weight"] = torch.randn(4 * d, d, generator=g) * d**-0.5
        out[p + "intermediate.dense.bias"] = torch.randn(4 * d, generator=g) * 0.02
        out[p + "output.dense.weight"] = torch.randn(d, 4 * d, generator=g) * (4 * d) ** -0.5
        out[p + "output.dense.bias"] = torch.randn(d, generator=g) * 0.02
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            out[p + ln + ".weight"] = 1 + torch.randn(d, generator=g) * 0.05
            out[p + ln + ".bias"] = torch.randn(d, generator=g) * 0.01
    out["pooler.dense.weight"] = torch.randn(d, d, generator=g) * d**-0.5
    out["pooler.dense.bias"] = torch.randn(d, generator=g) * 0.02
    return out


def _cast(tensors: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}


def _index(path) -> tuple[int, bytes]:
    """(bytes before the first stream, the decompressed index) of a format 2 file."""
    data = path.read_bytes()
    r = _Reader(data)
    r.pos = 8
    n = r.varint()
    return r.pos + n + 4, zstandard.ZstdDecompressor().decompress(data[r.pos : r.pos + n])


def _round_trip(tmp_path, tensors: dict, name: str = "a", **save) -> dict:
    src, packed, back = tmp_path / f"{name}.safetensors", tmp_path / f"{name}.isc", tmp_path / f"{name}.back"
    save_file(tensors, str(src), **save)
    stats = compress_file(src, packed)
    assert stats["bytes_out"] == packed.stat().st_size and stats["format"] == 2
    assert stats["index_bytes"] == _index(packed)[0]
    back_stats = decompress_file(packed, back)
    assert back.read_bytes() == src.read_bytes() and back_stats["format"] == 2
    return stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bitwise_per_dtype(tmp_path, dtype):
    tensors = _cast(_trained_like(n_layers=2), dtype)
    tensors["odd"] = (torch.randn(3, 5, 7) * 1e-3).to(dtype)  # odd element count
    tensors["one"] = torch.tensor([65504.0]).to(dtype)
    tensors["empty"] = torch.zeros(0, 4, dtype=dtype)
    tensors["scalar"] = torch.tensor(-0.0, dtype=dtype)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -1e-45, 0.0])
    tensors["specials"] = specials.to(dtype)
    stats = _round_trip(tmp_path, tensors, metadata={"format": "pt", "note": "é ünïcode"})
    assert stats["tensors"] == len(tensors)
    assert _index(tmp_path / "a.isc")[1][1] == 1  # the header kept without its data offsets


def test_every_dtype_and_irregular_files_round_trip(tmp_path):
    """Integers, bools, fp64, fp8, only empty tensors; and headers the reduced form cannot rebuild
    (tensors not in data order, padding no tensor claims, another JSON spacing): kept as they are."""
    tensors = {
        "i8": torch.arange(-5, 5, dtype=torch.int8),
        "u8": torch.arange(200, dtype=torch.uint8),
        "i16": torch.arange(9, dtype=torch.int16) * 300,
        "i32": torch.arange(11, dtype=torch.int32),
        "i64": torch.arange(1 << 13).reshape(8, -1),
        "b": torch.rand(77) > 0.5,
        "f64": torch.randn(5, 3, dtype=torch.float64),
        "f8": torch.randn(40).to(torch.float8_e4m3fn),
        "c64": torch.randn(6, dtype=torch.complex64),
    }
    _round_trip(tmp_path, tensors, "kinds")
    _round_trip(tmp_path, {"e": torch.zeros(0), "f": torch.zeros(3, 0, dtype=torch.float16)}, "empty")
    _round_trip(tmp_path, {}, "none")

    w, h = torch.randn(10, 3), torch.randn(6).half()
    raw_w, raw_h = w.numpy().tobytes(), h.numpy().tobytes()
    for label, header, body in [
        (
            "reordered",
            {
                "w": {"dtype": "F32", "shape": [10, 3], "data_offsets": [12, 132]},
                "h": {"dtype": "F16", "shape": [6], "data_offsets": [0, 12]},
            },
            raw_h + raw_w,
        ),
        (
            "padded",
            {
                "w": {"dtype": "F32", "shape": [10, 3], "data_offsets": [0, 120]},
                "h": {"dtype": "F16", "shape": [6], "data_offsets": [128, 140]},
            },
            raw_w + b"PADDING!" + raw_h + b"end",
        ),
        ("unknown dtype", {"w": {"dtype": "F4X", "shape": [5], "data_offsets": [0, 120]}}, raw_w),
        (
            "spaced",
            {"__metadata__": {"k": "v"}, "w": {"shape": [10, 3], "dtype": "F32", "data_offsets": [0, 120]}},
            raw_w,
        ),
    ]:
        text = json.dumps(header, indent=None if label != "spaced" else 1).encode()
        src = tmp_path / "hand.safetensors"
        src.write_bytes(struct.pack("<Q", len(text)) + text + body)
        compress_file(src, tmp_path / "hand.isc")
        decompress_file(tmp_path / "hand.isc", tmp_path / "hand.back")
        assert (tmp_path / "hand.back").read_bytes() == src.read_bytes(), label
        assert _index(tmp_path / "hand.isc")[1][1] == 0, label  # raw header form


def test_format_1_files_still_load(tmp_path):
    """V1_FILE: written by `islands ckpt compress` before format 2, restored byte for byte."""
    (tmp_path / "v1.isc").write_bytes(V1_FILE)
    stats = decompress_file(tmp_path / "v1.isc", tmp_path / "v1.safetensors")
    assert stats["format"] == 1 and stats["tensors"] == 7
    assert hashlib.sha256((tmp_path / "v1.safetensors").read_bytes()).hexdigest() == V1_SOURCE_SHA256
    # the format 1 writer kept for the tests is that version's: it writes the same bytes again (when this
    # safetensors library writes the same source file: it did at 0.8.0)
    save_file(v1_source(), str(tmp_path / "src.safetensors"), metadata={"note": "kept"})
    if hashlib.sha256((tmp_path / "src.safetensors").read_bytes()).hexdigest() == V1_SOURCE_SHA256:
        write_v1(tmp_path / "src.safetensors", tmp_path / "again.isc")
        assert (tmp_path / "again.isc").read_bytes() == V1_FILE
    # a bigger format 1 file of every float dtype, and damage in one still detected
    tensors = {**_cast(_trained_like(n_layers=1), torch.bfloat16), "h": torch.randn(300).half()}
    save_file(tensors, str(tmp_path / "big.safetensors"))
    write_v1(tmp_path / "big.safetensors", tmp_path / "big.isc")
    decompress_file(tmp_path / "big.isc", tmp_path / "big.back")
    assert (tmp_path / "big.back").read_bytes() == (tmp_path / "big.safetensors").read_bytes()
    damaged = bytearray((tmp_path / "big.isc").read_bytes())
    damaged[-20] ^= 4
    (tmp_path / "big.isc").write_bytes(bytes(damaged))
    with pytest.raises(CorruptCheckpoint):
        decompress_file(tmp_path / "big.isc", tmp_path / "big.back")


def test_every_damaged_byte_is_detected(tmp_path):
    """Each byte of a small container flipped in turn (index, every tensor's streams, the lead): every
    one raises CorruptCheckpoint, none writes a file. Truncation and extra bytes too."""
    g = torch.Generator().manual_seed(3)
    tensors = {
        "w": torch.randn(16, 8, generator=g) * 0.05,
        "b": torch.randn(64, generator=g).bfloat16(),
        "h": torch.randn(40, generator=g).half(),
        "i": torch.arange(9),
        "m": torch.tensor([True, False]),
    }
    src, packed = tmp_path / "s.safetensors", tmp_path / "s.isc"
    save_file(tensors, str(src))
    compress_file(src, packed)
    good = packed.read_bytes()
    for i in range(len(good)):
        for bit in (0x01, 0x80):
            bad = bytearray(good)
            bad[i] ^= bit
            packed.write_bytes(bytes(bad))
            out = tmp_path / f"out{i}"
            with pytest.raises(CorruptCheckpoint):
                decompress_file(packed, out)
            assert not out.exists()
    for bad in (good[:-1], good + b"\0", good[: len(good) // 2], good[:6]):
        packed.write_bytes(bad)
        with pytest.raises(CorruptCheckpoint):
            decompress_file(packed, tmp_path / "x")
    packed.write_bytes(b"ISLS" + struct.pack("<I", 9) + good[8:])
    with pytest.raises(CorruptCheckpoint, match="format 9"):
        decompress_file(packed, tmp_path / "x")


def test_a_damaged_index_byte_names_the_index(tmp_path):
    src, packed = tmp_path / "m.safetensors", tmp_path / "m.isc"
    save_file(_cast(_trained_like(n_layers=1), torch.float16), str(src))
    compress_file(src, packed)
    lead, _ = _index(packed)
    for at in (8, 12, lead // 2, lead - 5, lead - 1):
        bad = bytearray(packed.read_bytes())
        bad[at] ^= 0x10
        (tmp_path / "bad.isc").write_bytes(bytes(bad))
        with pytest.raises(CorruptCheckpoint, match="index"):
            decompress_file(tmp_path / "bad.isc", tmp_path / "bad.safetensors")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_overhead_per_tensor_is_bounded(tmp_path, dtype):
    """Everything that is not a tensor's codec streams (magic, version, the compressed index with the
    safetensors header, the codec headers with their XXH3s, the CRC and the file hash) over 103 tensors.
    MiniLM's 103 tensors measured 18.5 / 21.8 / 23.4 bytes per tensor (fp16 / bf16 / fp32) with format 2,
    343-358 with format 1; this stand-in has the same names and layout at a smaller width."""
    tensors = _cast(_trained_like(), dtype)
    assert len(tensors) == 104  # 103 float tensors and the int64 position ids, as in MiniLM
    stats = _round_trip(tmp_path, tensors, "m", metadata={"format": "pt"})
    per_tensor = stats["index_bytes"] / len(tensors)
    assert per_tensor <= 22, per_tensor  # 16.5-17.3 measured here
    write_v1(tmp_path / "m.safetensors", tmp_path / "m.v1")
    assert (tmp_path / "m.v1").stat().st_size - stats["bytes_out"] >= 200 * len(tensors)


def test_blob_parts_decode_as_the_whole_blob():
    for t in (torch.randn(1000) * 0.01, torch.randn(33).bfloat16(), torch.arange(50), torch.zeros(0)):
        blob = encode_tensor(t, content_hash=False)
        head, streams, version = blob_parts(blob)
        assert version == 7 and len(blob) == 5 + len(head) + len(streams) + 8
        assert blob_header.unpack(head)["shape"] == list(t.shape)
        assert torch.equal(decode_parts(head, streams, version=version), t)
        if len(streams):
            bad = bytearray(streams)
            bad[-1] ^= 1
            with pytest.raises(CorruptCheckpoint):
                decode_parts(head, bytes(bad), version=version)
