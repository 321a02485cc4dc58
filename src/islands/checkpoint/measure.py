"""Measurement cores for the checkpoint experiments (ckpt-codec, ckpt-stall); the bench wraps these."""

from __future__ import annotations

import time

import torch
import zstandard

from islands.checkpoint.async_writer import AsyncCheckpointer
from islands.checkpoint.codec import TensorCodec, decode_tensor, encode_tensor, tensor_bytes


def measure_codec(tensor: torch.Tensor, *, codec: TensorCodec | None = None, repeats: int = 3) -> dict:
    """Ratio and single-threaded MB/s of our codec and of plain zstd (level 3) on one tensor.

    Every round trip is checked byte for byte; a mismatch raises AssertionError (never reported as a number).
    """
    raw = tensor_bytes(tensor).tobytes()
    n = len(raw)

    def best(fn):
        times, out = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
        return min(times), out

    enc_s, blob = best(lambda: encode_tensor(tensor, codec=codec))
    dec_s, back = best(lambda: decode_tensor(blob))
    if tensor_bytes(back).tobytes() != raw:
        raise AssertionError("islands codec round trip is not byte-exact")
    z = zstandard.ZstdCompressor(level=3)
    zenc_s, zblob = best(lambda: z.compress(raw))
    zdec_s, zback = best(lambda: zstandard.ZstdDecompressor().decompress(zblob))
    if zback != raw:
        raise AssertionError("zstd round trip is not byte-exact")
    mb = n / 1e6
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "bytes": n,
            "islands": {"ratio": len(blob) / n, "compress_MBps": mb / enc_s, "decompress_MBps": mb / dec_s},
            "zstd3": {"ratio": len(zblob) / n, "compress_MBps": mb / zenc_s, "decompress_MBps": mb / zdec_s}}


def measure_stall(make_sink, tree, steps: list[int]) -> dict:
    """Training stall per checkpoint: synchronous save vs two-phase async save (SOTA-056).

    make_sink(): a fresh sink per mode (e.g. lambda: CheckpointStore(tmpdir)). Each async save waits for
    the previous persist first (outside the timed stall) so the numbers are per checkpoint, not queueing.
    """
    sync_sink, sync_s = make_sink(), []
    for step in steps:
        t0 = time.perf_counter()
        sync_sink.save(tree, step)
        sync_s.append(time.perf_counter() - t0)
    writer, stall_s, persist_s = AsyncCheckpointer(make_sink()), [], []
    for step in steps:
        writer.wait()
        handle = writer.save(tree, step)
        stall_s.append(handle.stall_s)
        handle.wait()
        if handle.error is not None:
            raise handle.error
        persist_s.append(handle.persist_s)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"sync_save_s": mean(sync_s), "async_stall_s": mean(stall_s), "async_persist_s": mean(persist_s),
            "stall_ratio": mean(stall_s) / mean(sync_s), "samples": len(steps)}
