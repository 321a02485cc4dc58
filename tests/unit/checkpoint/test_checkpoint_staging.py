"""Snapshot staging of the async writer: reused buffers, bounded by the memory budget, pinned only for CUDA."""

import pytest
import torch

from islands.checkpoint.store import AsyncCheckpointer
from islands.checkpoint.store.tree import copy_tree, staging_buffers, staging_tensor


class Keep:
    def __init__(self):
        self.ptrs = []

    def save(self, tree, step, **kw):
        self.ptrs.append({k: v.data_ptr() for k, v in tree.items()})


def test_staging_reused_across_saves_and_bounded_by_the_budget():
    sink = Keep()
    budget = 4 * 1000 + 4 * 10
    writer = AsyncCheckpointer(sink, memory_budget_bytes=budget)
    live = {"w": torch.zeros(1000), "b": torch.zeros(10)}
    for step in range(4):
        live["w"].fill_(step)
        h = writer.save(live, step)
        assert h.mode == "async"
        h.wait(10)
        assert 0 < writer.staging_bytes <= budget
    assert all(p == sink.ptrs[0] for p in sink.ptrs)  # one allocation, four snapshots
    first = sink.ptrs[0]["w"]
    # a tree past the budget is saved synchronously from the live tensors: no staging grows
    big = {"w": torch.zeros(1000), "b": torch.zeros(10), "extra": torch.zeros(100)}
    h = writer.save(big, 4)
    assert h.mode == "sync" and writer.staging_bytes <= budget
    assert sink.ptrs[-1]["w"] == big["w"].data_ptr()
    # back within budget: the kept buffers serve again
    h = writer.save(live, 5)
    h.wait(10)
    assert h.mode == "async" and sink.ptrs[-1]["w"] == first
    writer.close(10)


def test_reserve_makes_the_first_snapshots_buffers_ahead_and_they_hold_the_snapshot():
    sink = Keep()
    writer = AsyncCheckpointer(sink, memory_budget_bytes=10_000)
    live = {"w": torch.randn(1000), "n": torch.arange(7)}
    assert writer.reserve(live)
    assert not writer.reserve(live)  # one reserve at a time: nothing doubles the staging memory
    assert writer.wait_reserved(10) and writer.reserve_s is not None and writer.reserve_error is None
    assert writer.staging_bytes == 4 * 1000 + 8 * 7
    reserved = {k: v.data_ptr() for k, v in writer._reserved.items()}
    live["w"].mul_(2)  # values after the reserve are what the snapshot holds: reserve read only shapes
    h = writer.save(live, 1)
    h.wait(10)
    assert h.durable and sink.ptrs[0] == reserved
    assert not writer.reserve(live)  # buffers exist: the next snapshot reuses them anyway
    h = writer.save(live, 2)
    h.wait(10)
    assert sink.ptrs[1] == reserved
    writer.close(10)


def test_reserve_declines_a_tree_over_the_budget_and_a_shape_change_still_saves_exactly():
    writer = AsyncCheckpointer(Keep(), memory_budget_bytes=100)
    assert not writer.reserve({"w": torch.zeros(1000)}) and writer.staging_bytes == 0

    class Hold:
        def save(self, tree, step, **kw):
            self.tree = {k: v.clone() for k, v in tree.items()}

    sink = Hold()
    writer = AsyncCheckpointer(sink)
    assert writer.reserve({"w": torch.zeros(10), "gone": torch.zeros(3)})
    live = {"w": torch.arange(12.0)}  # the tree changed shape after the reserve: fresh buffers, same bytes
    h = writer.save(live, 1)
    h.wait(10)
    assert h.durable and torch.equal(sink.tree["w"], live["w"])
    writer.close(10)


def test_layout_change_drops_unfitting_buffers_first():
    a = copy_tree({"w": torch.ones(8), "old": torch.ones(1000)})
    b = copy_tree({"w": torch.full((8,), 2.0), "new": torch.ones(3)}, reuse=staging_buffers(a))
    assert staging_buffers(b)["w"].data_ptr() == staging_buffers(a)["w"].data_ptr()
    assert set(staging_buffers(b)) == {"w", "new"} and float(b["w"][0]) == 2.0
    c = copy_tree({"w": torch.ones(9)}, reuse=staging_buffers(b))  # shape changed: a fresh buffer
    assert staging_buffers(c)["w"].data_ptr() != staging_buffers(b)["w"].data_ptr()


def test_cpu_sources_stage_in_ordinary_memory():
    t = staging_tensor(torch.ones(4, 4, dtype=torch.bfloat16))
    assert t.device.type == "cpu" and not t.is_pinned() and t.dtype == torch.bfloat16 and t.shape == (4, 4)
    snap = copy_tree({"x": torch.arange(5)})
    assert not snap["x"].is_pinned()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the pinned branch)")
def test_cuda_sources_stage_in_pinned_memory_and_are_complete():
    src = {"x": torch.arange(1 << 20, device="cuda", dtype=torch.float32)}
    snap = copy_tree(src)
    assert snap["x"].is_pinned() and snap["x"].device.type == "cpu"
    assert torch.equal(snap["x"], src["x"].cpu())
    again = copy_tree(src, reuse=staging_buffers(snap))
    assert again["x"].data_ptr() == snap["x"].data_ptr()


def test_snapshot_buffers_are_aligned_views_of_one_block_and_save_like_the_live_tree(tmp_path):
    from islands.checkpoint import CheckpointStore

    live = {
        "w": torch.randn(33, 7),
        "half": torch.randn(5).half(),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "strided": torch.arange(40, dtype=torch.int32).reshape(5, 8)[:, ::2],
    }
    snap = copy_tree(live)
    bufs = staging_buffers(snap)
    storages = {b.untyped_storage().data_ptr() for b in bufs.values() if b.numel()}
    assert len(storages) == 1  # one allocation (one page-locking call for CUDA state)
    base = storages.pop()
    assert all((b.data_ptr() - base) % 256 == 0 for b in bufs.values() if b.numel())  # aligned for any dtype
    for name, t in live.items():
        assert bufs[name].dtype == t.dtype and torch.equal(bufs[name], t)
    store = CheckpointStore(tmp_path / "s")
    store.save(snap, 1)
    loaded = store.load().tree
    assert all(torch.equal(loaded[n], t) for n, t in live.items())
