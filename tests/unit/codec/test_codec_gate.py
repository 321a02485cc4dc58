"""Which coder each stream gets: the mantissa gate samples the whole plane (not only its start), and
Huffman-coded streams are written in small zstd blocks that any zstd decoder still reads (given back
the magic that format 6 and 7 frames leave out)."""

import zlib

import numpy as np
import torch
import zstandard

from harness.legacy_blobs import legacy_blob, legacy_parts, ordinary_frame
from islands.checkpoint.codec.planes import sampled_entropy_bits
from islands.checkpoint.codec.tensor import decode_tensor, encode_tensor, read_header, tensor_bytes


def _streams(blob):
    """(metadata, ordinary zstd frame, or the plane itself for a raw stream) of every stream."""
    from harness.legacy_blobs import frames

    return [(meta, f if meta["m"] == "r" else ordinary_frame(f)) for meta, f in frames(blob)]


def test_entropy_estimate_separates_noise_from_skewed_bytes():
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, 1 << 20).astype(np.uint8)
    assert 7.95 < sampled_entropy_bits(noise) < 8.05
    skewed = np.minimum(rng.geometric(0.05, 1 << 20), 255).astype(np.uint8)  # ~5.7 bits
    assert sampled_entropy_bits(skewed) < 6.5
    # A plane whose compressible part is only its last quarter still reads as compressible.
    mixed = noise.copy()
    mixed[-(1 << 18) :] = 0
    assert sampled_entropy_bits(mixed) < 7.9


def test_fp16_exact_tail_in_a_noisy_fp32_chunk_is_huffman_coded():
    # v3 probed only a plane's first 64 KiB: a chunk that starts with a full-precision tensor and ends
    # with an fp16-exact one (a pooler after the last layer, in the MiniLM bench) was stored raw.
    g = torch.Generator().manual_seed(1)
    head = torch.randn(600_000, generator=g) * 0.02
    tail = (torch.randn(200_000, generator=g) * 0.02).half().float()  # low 13 mantissa bits zero
    t = torch.cat([head, tail])
    blob = encode_tensor(t, content_hash=False)
    streams = _streams(blob)
    low = [meta for meta, _ in streams][-2:]  # mantissa bytes m15..m8 and m7..m0
    assert [m["m"] for m in low] == ["h", "h"]
    assert all(m["enc"] < 0.93 * m["raw"] for m in low)
    assert np.array_equal(tensor_bytes(decode_tensor(blob)), tensor_bytes(t))


def test_noise_mantissa_is_stored_and_small_planes_are_offered_to_huffman():
    g = torch.Generator().manual_seed(2)
    big = encode_tensor(torch.randn(400_000, generator=g), content_hash=False)
    # the top mantissa byte, and the two noise bytes below it as one stored plane of 16-bit words
    assert [(m["m"], m["raw"]) for m, _ in _streams(big)][-2:] == [("r", 400_000), ("r", 800_000)]
    small = encode_tensor(torch.randn(3_000, generator=g), content_hash=False)
    assert [m["m"] for m, _ in _streams(small)][-3:] == ["h", "h", "h"]
    for blob, n in ((big, 400_000), (small, 3_000)):
        assert decode_tensor(blob).numel() == n


def _block_sizes(frame: bytes) -> list[int]:
    """Decoded sizes of a zstd frame's blocks, read from the 3-byte block headers (RFC 8878 3.1.1.2)."""
    pos, sizes = zstandard.frame_header_size(frame), []
    while True:
        head = int.from_bytes(frame[pos : pos + 3], "little")
        last, kind, size = head & 1, (head >> 1) & 3, head >> 3
        pos += 3 + (1 if kind == 1 else size)  # an RLE block stores one byte; size is its decoded length
        sizes.append(size if kind != 2 else -1)  # compressed blocks: decoded size not in the header
        if last:
            return sizes


def test_blocked_streams_are_ordinary_zstd_frames_with_their_size():
    w = (torch.randn(1 << 20, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    blob = encode_tensor(w)
    plain = zstandard.ZstdDecompressor()
    raw = [f for meta, f in _streams(blob) if meta["m"] == "r"]
    x = w.view(torch.int16).numpy().view(np.uint16)
    assert raw == [(((x >> 8) & 0x80) | (x & 0x7F)).astype(np.uint8).tobytes()]  # s|m6..m0, as it is
    for meta, frame in _streams(blob):
        if meta["m"] == "r":  # the sign|mantissa plane, noise: stored raw, no frame
            continue
        params = zstandard.get_frame_parameters(frame)
        assert not params.has_checksum and params.content_size == meta["raw"]  # the chunk XXH3 guards it
        assert len(plain.decompress(frame)) == meta["raw"]
    pairs = next(meta for meta, _ in _streams(blob) if meta["m"] == "p")
    frame = next(f for meta, f in _streams(blob) if meta["m"] == "p")
    assert pairs["raw"] > 4 * (64 << 10) and len(_block_sizes(frame)) >= pairs["raw"] // (64 << 10)
    assert torch.equal(decode_tensor(blob).view(torch.int16), w.view(torch.int16))


def test_huffman_streams_are_cut_into_blocks_no_longer_than_their_window():
    # One compress call per stream; zstd never makes a block longer than its window (streams.py).
    g = torch.Generator().manual_seed(4)
    w = torch.randn(600_000, generator=g) * 0.02
    for t, kind, block in (
        (w.to(torch.bfloat16), "p", 64 << 10),
        (w.to(torch.float16), "h", 128 << 10),
        (torch.cat([w, w.half().float()]), "h", 32 << 10),
    ):
        streams = [(m, f) for m, f in _streams(encode_tensor(t, content_hash=False)) if m["m"] == kind]
        assert streams
        meta, frame = max(streams, key=lambda s: s[0]["raw"])
        assert meta["raw"] > 2 * block
        assert len(_block_sizes(frame)) >= -(-meta["raw"] // block)


def _reframe_by_flushing(blob: bytes, block: int) -> bytes:
    """The same tensor as the first v3 encoder wrote it: every Huffman stream re-cut by a streaming
    compressor flushed every `block` bytes (header sizes and CRCs rewritten to match)."""
    header, frames = legacy_parts(blob)
    coder = zstandard.ZstdCompressor(
        compression_params=zstandard.ZstdCompressionParameters(
            compression_level=1,
            strategy=zstandard.STRATEGY_FAST,
            min_match=7,
            window_log=17,
            hash_log=6,
            chain_log=6,
            search_log=1,
            write_checksum=True,
        )
    )
    metas = [meta for chunk in header["chunks"] for meta in chunk["streams"]]
    for i, meta in enumerate(metas):
        if meta["m"] in ("h", "p", "x"):
            raw = zstandard.ZstdDecompressor().decompress(frames[i])
            obj, parts = coder.compressobj(size=len(raw)), []
            for b in range(0, len(raw), block):
                parts.append(obj.compress(raw[b : b + block]))
                if b + block < len(raw):
                    parts.append(obj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
            parts.append(obj.flush())
            frames[i] = b"".join(parts)
            meta.update(enc=len(frames[i]), hcrc=zlib.crc32(frames[i][:64]))
    return legacy_blob(header, frames, version=3)


def test_blobs_of_the_flushing_v3_encoder_still_decode():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(300_000, generator=g) * 0.02
    w[::997] = 0.0  # escapes, so the side stream exists too
    for t in (w.to(torch.bfloat16), w, w.to(torch.float16)):
        new = encode_tensor(t)
        old = _reframe_by_flushing(new, 32 << 10)
        assert old != new and len(read_header(old)[0]["chunks"]) == len(read_header(new)[0]["chunks"])
        assert np.array_equal(tensor_bytes(decode_tensor(old)), tensor_bytes(t))
