"""Async two-phase writer and multi-level restore."""

import threading

import pytest
import torch

from islands.checkpoint import CheckpointStore, CorruptCheckpoint, NoCheckpoint
from islands.checkpoint.store import (
    AsyncCheckpointer,
    DiskLevel,
    MemoryLevel,
    MultiLevelCheckpointer,
    pack_tree,
    unpack_tree,
)
from islands.checkpoint.store.manifest import data_name


class SlowSink:
    """Records what it was handed; blocks until released, like a slow disk."""

    def __init__(self):
        self.release = threading.Event()
        self.saved = {}

    def save(self, tree, step, **kwargs):
        assert self.release.wait(10)
        self.saved[step] = tree
        return step


def test_snapshot_is_private_and_persist_runs_in_background():
    sink = SlowSink()
    writer = AsyncCheckpointer(sink)
    live = {"w": torch.zeros(100)}
    handle = writer.save(live, 1)
    assert not handle.done() and not handle.durable and handle.mode == "async"
    live["w"].add_(5)  # training goes on and changes the live tensors
    sink.release.set()
    assert handle.wait(10) and handle.durable and handle.error is None
    assert torch.equal(sink.saved[1]["w"], torch.zeros(100))
    assert handle.stall_s >= 0 and handle.persist_s > 0


def test_second_save_waits_or_is_skipped_by_policy():
    sink = SlowSink()
    skipper = AsyncCheckpointer(sink, when_busy="skip")
    first = skipper.save({"w": torch.ones(3)}, 1)
    second = skipper.save({"w": torch.ones(3)}, 2)
    assert second.mode == "skipped" and second.done() and not second.durable
    sink.release.set()
    assert first.wait(10) and first.durable and 2 not in sink.saved

    sink2 = SlowSink()
    waiter = AsyncCheckpointer(sink2, when_busy="wait")
    waiter.save({"w": torch.ones(3)}, 1)
    threading.Timer(0.2, sink2.release.set).start()
    h2 = waiter.save({"w": torch.ones(3)}, 2)
    assert h2.wait_s >= 0.1 and h2.stall_s >= h2.wait_s  # waiting counts as stall
    assert waiter.close(10) and sorted(sink2.saved) == [1, 2]


def test_over_budget_saves_synchronously_or_raises():
    sink = SlowSink()
    sink.release.set()
    writer = AsyncCheckpointer(sink, memory_budget_bytes=100)
    handle = writer.save({"w": torch.zeros(1000)}, 1)
    assert handle.mode == "sync" and handle.durable
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        AsyncCheckpointer(sink, memory_budget_bytes=100, over_budget="error").save({"w": torch.zeros(1000)}, 2)


def test_persist_error_is_reported_on_the_handle(tmp_path):
    class Broken:
        def save(self, tree, step):
            raise OSError("disk full")

    handle = AsyncCheckpointer(Broken()).save({"w": torch.ones(2)}, 1)
    assert handle.wait(10) and not handle.durable and isinstance(handle.error, OSError)


def test_async_with_real_store_round_trips_and_staging_copy_unchanged(tmp_path):
    store = CheckpointStore(tmp_path)
    writer = AsyncCheckpointer(store)
    tree = {"w": torch.randn(1000), "step": 3}
    handle = writer.save(tree, 3)
    assert handle.wait(30) and handle.durable, handle.error
    assert torch.equal(store.load().tree["w"], tree["w"])


def test_packed_tree_detects_damage():
    data = pack_tree({"w": torch.arange(100.0), "k": [1, (2, 3)]}, 5)
    step, tree = unpack_tree(data)
    assert step == 5 and tree["k"] == [1, (2, 3)] and torch.equal(tree["w"], torch.arange(100.0))
    bad = bytearray(data)
    bad[-10] ^= 1
    with pytest.raises(CorruptCheckpoint):
        unpack_tree(bytes(bad))


def test_levels_save_on_their_own_intervals_and_restore_newest_intact(tmp_path):
    replicas = {}
    memory = MemoryLevel(every=1, replicate=lambda step, data: replicas.update(latest=data))
    local = DiskLevel(CheckpointStore(tmp_path / "local"), every=2, name="local")
    remote = DiskLevel(CheckpointStore(tmp_path / "remote"), every=4, name="remote")
    levels = MultiLevelCheckpointer([memory, local, remote])
    assert levels.due(4) == ["memory", "local", "remote"] and levels.due(3) == ["memory"]
    for step in range(1, 6):
        levels.save({"w": torch.full((10,), float(step))}, step)
    r = levels.restore()
    assert (r.step, r.level) == (5, "memory")

    memory.data = None  # process restarted: memory lost, peer copy still there
    assert (levels.restore().level, levels.restore().step) == ("local", 4)

    # peer copy comes back through fetch: newest again
    memory.fetch = lambda: replicas["latest"]
    assert (levels.restore().step, levels.restore().level) == (5, "memory")
    memory.fetch = None

    # damage local step 4: fall back past it to remote step 4
    f = tmp_path / "local" / "step-000004" / data_name(0)
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x40
    f.write_bytes(bytes(raw))
    r = levels.restore()
    assert (r.step, r.level) == (4, "remote") and r.skipped and r.skipped[0][:2] == ("local", 4)
    assert r.tree["w"][0].item() == 4.0


def test_restore_with_nothing_anywhere_is_a_clear_error(tmp_path):
    levels = MultiLevelCheckpointer([MemoryLevel(), DiskLevel(CheckpointStore(tmp_path), every=1)])
    with pytest.raises(NoCheckpoint):
        levels.restore()
    with pytest.raises(ValueError, match="every"):
        MemoryLevel(every=0)
