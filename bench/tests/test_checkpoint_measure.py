"""measure_codecs with per-tensor candidates: sizes summed, outputs joined, a wrong round trip refused."""

import pytest
import torch

from islands.checkpoint.codec import tensor_bytes
from islands_bench.checkpoint_measure import codec_candidates, measure_codecs, per_tensor


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g).bfloat16() for n in (7, 5000, 1)]


def test_per_tensor_sums_the_blobs_and_joins_the_outputs():
    ts = _tensors()
    raw = b"".join(tensor_bytes(t).tobytes() for t in ts)
    singles = [codec_candidates(t)["islands"] for t in ts]
    m = measure_codecs(raw, {"islands": per_tensor(singles)}, repeats=1)["islands"]
    blobs = [compress(prepare()) for prepare, compress, _ in singles]
    assert m["ratio"] == sum(len(b) for b in blobs) / len(raw)


def test_a_per_tensor_round_trip_out_of_order_is_refused():
    ts = _tensors()
    raw = b"".join(tensor_bytes(t).tobytes() for t in ts)
    prepare, compress, decompress = per_tensor([codec_candidates(t)["islands"] for t in ts])
    swapped = (prepare, compress, lambda blobs: decompress(blobs)[::-1])
    with pytest.raises(AssertionError, match="not byte-exact"):
        measure_codecs(raw, {"swapped": swapped}, repeats=1)


@pytest.mark.parametrize("settle", [True, False])
def test_trimmed_and_warm_heap_rounds_measure_the_same_bytes(settle):
    ts = _tensors()
    raw = b"".join(tensor_bytes(t).tobytes() for t in ts)
    singles = [codec_candidates(t)["islands"] for t in ts]
    m = measure_codecs(raw, {"islands": per_tensor(singles)}, repeats=2, settle=settle)["islands"]
    assert m["bytes"] == sum(len(compress(prepare())) for prepare, compress, _ in singles)
    assert m["compress_MBps"] > 0 and m["decompress_MBps"] > 0


def test_measure_stall_saves_new_bytes_each_time_only_when_the_state_advances(tmp_path):
    from itertools import count

    from islands.checkpoint import CheckpointStore
    from islands_bench.checkpoint_measure import measure_stall

    tree = {"w": torch.randn(4096), "b": torch.randn(64)}
    n = count()

    def sink():
        return CheckpointStore(tmp_path / f"s{next(n)}", keep_last=1)

    def advance():
        tree["w"].add_(1.0)
        tree["b"].mul_(1.5)

    still = measure_stall(sink, tree, [1, 2, 3])
    moving = measure_stall(sink, tree, [1, 2, 3], advance=advance)
    assert still["sync_deduped_bytes"] == 2 * (4096 + 64) * 4  # unchanged: every save after the first a dedup hit
    assert moving["sync_deduped_bytes"] == 0
    assert moving["reserve_s"] is not None and moving["samples"] == 3
    assert all(moving[k] > 0 for k in ("sync_save_s", "async_stall_s", "async_persist_s"))
