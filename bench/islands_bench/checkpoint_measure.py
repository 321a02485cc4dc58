"""Measurement cores for the checkpoint experiments (ckpt-codec, ckpt-stall); the bench wraps these."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from collections.abc import Callable

import torch
import zstandard

from islands.checkpoint.codec import TensorCodec, decode_tensor, encode_tensor, tensor_bytes
from islands.checkpoint.store import AsyncCheckpointer

# (prepare, compress, decompress): prepare() runs outside the timing and its result is what compress
# gets (ZipNN writes into its input, so it needs a fresh copy each round); decompress returns bytes-like
# or a tensor.
Codec = tuple[Callable[[], object], Callable[[object], object], Callable[[object], object]]


def codec_candidates(tensor: torch.Tensor, *, codec: TensorCodec | None = None) -> dict[str, Codec]:
    """Our codec two ways, and plain zstd level 3, as `Codec` triples.

    "islands": the codec's own work as the store calls it: the SHA-256 content hash is kept in the
    store's manifest (computed there once, for dedup), not in the blob, and not part of this timing;
    every stream's checksums are still written and verified. "islands+sha256": the hash computed
    inside the encode, stored in the blob and checked after the decode, as a standalone
    `encode_tensor` call does.
    """
    raw = tensor_bytes(tensor).tobytes()
    z, dz = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    none = lambda: None  # noqa: E731
    return {
        "islands": (
            none,
            lambda _: encode_tensor(tensor, codec=codec, content_hash=False),
            lambda blob: decode_tensor(blob, verify=False),
        ),
        "islands+sha256": (
            none,
            lambda _: encode_tensor(tensor, codec=codec),
            lambda blob: decode_tensor(blob, verify=True),
        ),
        "zstd-3": (none, lambda _: z.compress(raw), dz.decompress),
    }


def per_tensor(codecs: list[Codec]) -> Codec:
    """One candidate out of one `Codec` per tensor, called in a row as a checkpoint store does; its blob
    and its output are the lists of theirs (measure_codecs sums and joins them outside the timing)."""
    return (
        lambda: [prepare() for prepare, _, _ in codecs],
        lambda given: [compress(g) for (_, compress, _), g in zip(codecs, given)],
        lambda blobs: [decompress(b) for (_, _, decompress), b in zip(codecs, blobs)],
    )


def measure_codecs(
    raw: bytes, candidates: dict[str, Codec], *, repeats: int = 5, settle: bool = True
) -> dict[str, dict]:
    """Ratio and single-threaded MB/s of each candidate on the same bytes, rounds interleaved.

    Time is this process's CPU time (time.process_time), best of `repeats`: on a machine shared with
    other jobs, wall time mostly measures the neighbours, and interleaving gives every codec the same
    conditions. Every round trip is compared byte for byte; a mismatch raises AssertionError (never a
    number). A candidate may work on many tensors at once: its blob and its output are then lists
    (sizes summed, outputs joined for the comparison, outside the timing). `settle` starts every timed
    call from a trimmed heap (settle_allocator); without it each call inherits the allocator state the
    calls before it left (the "warm heap" rows of ckpt-codec).
    """
    enc: dict[str, list[float]] = {name: [] for name in candidates}
    dec: dict[str, list[float]] = {name: [] for name in candidates}
    blobs: dict[str, object] = {}
    for _ in range(repeats):
        for name, (prepare, compress, decompress) in candidates.items():
            given = prepare()
            if settle:
                settle_allocator()
            t0 = time.process_time()
            blob = compress(given)
            enc[name].append(time.process_time() - t0)
            if settle:
                settle_allocator()
            t0 = time.process_time()
            back = decompress(blob)
            dec[name].append(time.process_time() - t0)
            if _joined(back) != raw:
                raise AssertionError(f"{name} round trip is not byte-exact")
            blobs[name] = blob
    mb = len(raw) / 1e6
    return {
        name: {
            "ratio": _size(blobs[name]) / max(1, len(raw)),
            "bytes": _size(blobs[name]),
            "compress_MBps": mb / max(min(enc[name]), 1e-9),
            "decompress_MBps": mb / max(min(dec[name]), 1e-9),
            "compress_s_median": sorted(enc[name])[len(enc[name]) // 2],
        }
        for name in candidates
    }


def settle_allocator() -> None:
    """Put every timed call on the same footing: free what is garbage and hand the allocator's free
    memory back to the OS (glibc malloc_trim), so each call starts from a trimmed heap.

    Without it a codec's time depended on which codec ran before it in the same process: a call that
    finds freed pages to reuse page-faults ~0 times, one that does not faults once per 4 KiB (~3 us
    each here). Measured on the per-tensor bf16 rows: ours 0.93x to 1.13x ZipNN's decode speed
    depending only on the order and allocations around the calls. A trimmed heap is the state of a
    process that loads a checkpoint: every tensor it decodes is fresh memory.
    """
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()


def _joined(out) -> bytes:
    """A candidate's output as one bytes object, outside the timing: each candidate returns what it
    naturally makes (our decode a tensor, ZipNN a bytearray, zstd bytes), one or a list of them."""
    if isinstance(out, (list, tuple)):
        return b"".join(_bytes_of(o) for o in out)
    return _bytes_of(out)


def _bytes_of(o) -> bytes:
    return tensor_bytes(o).tobytes() if isinstance(o, torch.Tensor) else bytes(memoryview(o).cast("B"))


def _size(blob) -> int:
    if isinstance(blob, (list, tuple)):
        return sum(_size(b) for b in blob)
    return len(memoryview(blob).cast("B"))


def measure_stall(make_sink, tree, steps: list[int], *, advance: Callable[[], None] | None = None) -> dict:
    """Training stall per checkpoint: synchronous save vs two-phase async save (SOTA-056).

    make_sink(): a fresh sink per mode (e.g. lambda: CheckpointStore(tmpdir)). Each async save waits for
    the previous persist first (outside the timed stall) so the numbers are per checkpoint, not queueing.
    advance(): changes the tree's values in place as a training step does, before every save of both
    modes, outside the timing. Without it every save after the first finds each tensor's bytes in the
    previous checkpoint (the store dedups by content hash) and measures a hash pass, not a save: 123 ms
    against 595 ms for a 131 MB state. `sync_deduped_bytes` says how much the synchronous saves found.
    Before the timing, one save into a throwaway sink pays the codec's first-call costs (compiled kernels
    loaded, coder contexts made) for both modes, and AsyncCheckpointer.reserve makes the staging buffers,
    as the trainer does after its first step; that takes `reserve_s`, a one-off setup, not a stall.
    """
    make_sink().save(tree, 0)
    sync_sink, sync_s, deduped = make_sink(), [], 0
    for step in steps:
        if advance is not None:
            advance()
        t0 = time.perf_counter()
        result = sync_sink.save(tree, step)
        sync_s.append(time.perf_counter() - t0)
        deduped += getattr(result, "bytes_deduped", 0)
    writer, stall_s, persist_s = AsyncCheckpointer(make_sink()), [], []
    writer.reserve(tree)
    writer.wait_reserved()
    for step in steps:
        if advance is not None:
            advance()
        writer.wait()
        handle = writer.save(tree, step)
        stall_s.append(handle.stall_s)
        handle.wait()
        if handle.error is not None:
            raise handle.error
        persist_s.append(handle.persist_s)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    steady = stall_s[1:] or stall_s
    return {
        "sync_save_s": mean(sync_s),
        "async_stall_s": mean(stall_s),
        "async_persist_s": mean(persist_s),
        "stall_ratio": mean(stall_s) / mean(sync_s),
        "samples": len(steps),
        "async_stall_first_s": stall_s[0],
        "async_stall_steady_s": mean(steady),
        "steady_stall_ratio": mean(steady) / mean(sync_s),
        "reserve_s": writer.reserve_s,
        "sync_deduped_bytes": deduped,
    }
