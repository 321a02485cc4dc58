"""CheckpointStore: round trip, dedup, retention, mismatch messages, fallback, crash at every write phase."""

import random
import re
import threading

import numpy as np
import pytest
import torch

from islands.checkpoint import CheckpointMismatch, CheckpointStore, CorruptCheckpoint, NoCheckpoint
from islands.checkpoint.codec.tensor import tensor_bytes
from islands.checkpoint.store.manifest import data_name

PHASES = [
    "staging_mkdir",
    "data_write",
    "manifest_write",
    "staging_fsync",
    "commit_rename",
    "root_fsync",
    "latest_tmp_write",
    "latest_rename",
    "latest_dir_fsync",
    "retention",
]


def trainer_tree(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    return {
        "step": 7,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "strategy": {"outer": {"momentum": torch.zeros(3)}, "members": [0, 1]},
        "loader": {"epoch": 0, "cursor": 37},
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        "blob": b"\x00\x01raw",
        "config_fingerprint": "sha256:abc",
    }


def assert_trees_equal(a, b):
    # state_dict() returns an OrderedDict; the store gives back a plain dict (same order, same contents)
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(tensor_bytes(a), tensor_bytes(b))  # bitwise, NaNs included
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b) and a.dtype == b.dtype
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_trees_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_trees_equal(x, y)
    else:
        assert a == b


def test_round_trip_preserves_types_int_keys_tuples_and_rng_states(tmp_path):
    tree = trainer_tree()
    store = CheckpointStore(tmp_path)
    store.save(tree, 7)
    loaded = store.load()
    assert loaded.step == 7 and store.latest_step() == 7
    assert_trees_equal(loaded.tree, tree)
    # the restored model, optimizer and RNG states are usable as-is
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    model.load_state_dict(loaded.tree["model"])
    torch.optim.AdamW(model.parameters()).load_state_dict(loaded.tree["optimizer"])
    random.setstate(loaded.tree["rng"]["python"])
    np.random.set_state(loaded.tree["rng"]["numpy"])
    assert not list(tmp_path.glob("*.tmp-*"))
    assert not any(p.suffix == ".pkl" for p in tmp_path.rglob("*"))


def test_unchanged_tensors_are_referenced_not_rewritten(tmp_path):
    tree = trainer_tree()
    store = CheckpointStore(tmp_path, keep_last=1)
    first = store.save(tree, 1)
    tree["model"]["0.weight"] = tree["model"]["0.weight"] + 1
    second = store.save(tree, 2)
    assert second.tensors_written == 1 and second.tensors_deduped == first.tensors_written - 1
    assert (tmp_path / "step-000002" / data_name(0)).stat().st_size < (
        tmp_path / "step-000001" / data_name(0)
    ).stat().st_size
    # keep_last=1, but step 1 still holds data step 2 reads: retention must keep it
    assert store.steps() == [1, 2]
    assert_trees_equal(CheckpointStore(tmp_path).load().tree, tree)


def test_retention_keeps_last_n_and_drops_unreferenced(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in range(5):
        store.save({"w": torch.full((10,), float(step))}, step)
    assert store.steps() == [3, 4]
    assert store.load(3).tree["w"][0] == 3


def test_mismatch_names_what_differs(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save({"model": {"a": torch.zeros(2, 3), "b": torch.zeros(4)}, "config_fingerprint": "f1"}, 1)
    like = {"model": {"a": torch.zeros(3, 3), "c": torch.zeros(4)}}
    with pytest.raises(CheckpointMismatch) as info:
        store.load(like=like, fingerprint="f2")
    text = str(info.value)
    assert "model/c" in text and "missing" in text
    assert "model/b" in text and "unexpected" in text
    assert "shape mismatch for 'model/a'" in text and "(2, 3)" in text
    assert "fingerprint" in text and "f1" in text and "f2" in text


def test_damaged_latest_falls_back_to_previous_and_explicit_step_raises(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=3)
    store.save({"w": torch.ones(1000)}, 1)
    store.save({"w": torch.full((1000,), 2.0)}, 2)
    data = tmp_path / "step-000002" / data_name(0)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    loaded = CheckpointStore(tmp_path).load()
    assert loaded.step == 1 and loaded.skipped and "step-000002" in loaded.skipped[0][0]
    with pytest.raises(CorruptCheckpoint):
        store.load(2)
    assert store.verify(2) and not store.verify(1)


def test_manifests_of_before_session_9_with_a_crc32_per_blob_still_load_and_catch_damage(tmp_path):
    import zlib

    from islands.checkpoint.store.manifest import encode_manifest, manifest_name, read_manifest

    store = CheckpointStore(tmp_path)
    store.save({"w": torch.arange(5000.0)}, 1)
    path = tmp_path / "step-000001" / manifest_name(0)
    body = read_manifest(path)
    data = (tmp_path / "step-000001" / data_name(0)).read_bytes()
    (entry,) = body["tensors"].values()
    assert set(entry) >= {"xxh3", "length"} and "checksum" not in entry
    blob = data[entry["offset"] : entry["offset"] + entry["length"]]
    del entry["xxh3"]
    entry["checksum"] = zlib.crc32(blob)  # what the store wrote before
    path.write_bytes(encode_manifest(body))
    assert torch.equal(CheckpointStore(tmp_path).load().tree["w"], torch.arange(5000.0))
    entry["checksum"] ^= 1
    path.write_bytes(encode_manifest(body))
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch"):
        CheckpointStore(tmp_path).load(1)


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(NoCheckpoint):
        CheckpointStore(tmp_path).load()


@pytest.mark.parametrize("phase", PHASES)
def test_crash_at_every_write_phase_leaves_previous_loadable(tmp_path, phase):
    CheckpointStore(tmp_path).save({"w": torch.ones(50), "n": 1}, 1)

    def crash(name):
        if name == phase:
            raise KeyboardInterrupt(f"simulated crash at {name}")

    store = CheckpointStore(tmp_path, fault_hook=crash, keep_last=1)
    with pytest.raises(KeyboardInterrupt):
        store.save({"w": torch.zeros(50), "n": 2}, 2)
    reopened = CheckpointStore(tmp_path)
    assert not list(tmp_path.glob("*.tmp-*"))  # partial work cleaned at open
    loaded = reopened.load()
    committed = PHASES.index(phase) > PHASES.index("latest_rename")  # the pointer move is the commit
    assert loaded.tree["n"] == (2 if committed else 1) and not loaded.skipped


def test_delta_mode_round_trips_and_keeps_its_base(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=1, delta_every=3)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5000, generator=g)
    for step in range(5):
        w = w + 1e-3 * torch.randn(5000, generator=g)
        store.save({"w": w.clone()}, step)
    assert torch.equal(CheckpointStore(tmp_path).load().tree["w"], w)
    assert 3 in store.steps()  # step 4 is a delta against the base written at step 3


def test_multi_rank_save_commits_once_all_ranks_wrote(tmp_path):
    world = 2
    barrier = threading.Barrier(world, timeout=30)
    errors = []

    def rank_main(rank):
        try:
            store = CheckpointStore(tmp_path, rank=rank, world_size=world, barrier=barrier.wait, clean=rank == 0)
            barrier.wait()  # as the training loop's first collective does: rank 0's clean-up ends before any save
            store.save({"shard": torch.full((4,), float(rank))}, 10)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    store = CheckpointStore(tmp_path)
    assert store.latest_step() == 10
    assert [store.load(rank=r).tree["shard"][0].item() for r in range(world)] == [0.0, 1.0]
    assert store.verify(10) == []


def test_a_rank_that_loses_rank_0_after_its_commit_counts_the_save_and_not_before(tmp_path):
    # An elastic member waiting for rank 0's "committed" sees rank 0 vanish: whether the save counts is
    # whether `latest` names it (the barrier cannot tell, the store can).
    class RankZeroGone(RuntimeError):
        pass

    rank0 = CheckpointStore(tmp_path, rank=0, world_size=2, barrier=lambda: None)  # its waits: in rank 1's
    calls = []

    def rank1_barrier():  # rank 1's two barriers per save: before rank 0 commits, and after
        calls.append(1)
        if len(calls) == 1:  # rank 1's part is in: rank 0 writes its own and commits step 5
            rank0.save({"shard": torch.zeros(4)}, 5, token="e0")
        elif len(calls) in (2, 4):  # then vanishes before saying so; and never commits step 10
            raise RankZeroGone("rank 0 left while it committed")

    rank1 = CheckpointStore(tmp_path, rank=1, world_size=2, barrier=rank1_barrier, clean=False)
    rank1.save({"shard": torch.ones(4)}, 5, token="e0")  # counts: `latest` names step 5
    assert rank1.latest_step() == 5 and torch.equal(rank1.load(5, rank=1).tree["shard"], torch.ones(4))
    with pytest.raises(RankZeroGone):
        rank1.save({"shard": torch.ones(4)}, 10, token="e1")  # does not: `latest` still names 5
    assert CheckpointStore(tmp_path).latest_step() == 5 and len(calls) == 4


def test_a_rank_that_loses_rank_0_between_its_rename_and_latest_counts_the_save(tmp_path):
    # CI, stop 25: rank 0 SIGKILLed after renaming the staging directory but before moving `latest`;
    # the step's directory is whole and listed, so the survivor must count it, not call it abandoned.
    class Killed(RuntimeError):
        pass

    def die_before_latest(phase):
        if phase == "root_fsync":  # right after os.replace(staging, final)
            raise Killed(phase)

    rank0 = CheckpointStore(tmp_path, rank=0, world_size=2, barrier=lambda: None, fault_hook=die_before_latest)
    calls = []

    def rank1_barrier():
        calls.append(1)
        if len(calls) == 1:
            with pytest.raises(Killed):
                rank0.save({"shard": torch.zeros(4)}, 5, token="e0")
        else:
            raise RuntimeError("rank 0 left while it committed")

    rank1 = CheckpointStore(tmp_path, rank=1, world_size=2, barrier=rank1_barrier, clean=False)
    rank1.save({"shard": torch.ones(4)}, 5, token="e0")  # no raise: the save counts
    assert rank1.steps() == [5] and rank1.latest_step() is None and rank1.verify(5) == []
    assert torch.equal(rank1.load(5, rank=1).tree["shard"], torch.ones(4))


def _ranks(world, target):
    """Run target(rank, barrier) on `world` threads standing for ranks; returns their errors."""
    barrier = threading.Barrier(world, timeout=30)
    errors = []

    def main(rank):
        try:
            target(rank, barrier)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the caller
            errors.append((rank, exc))
            barrier.abort()  # as a dead rank's peers see a collective fail

    threads = [threading.Thread(target=main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


def replica_tree(rank, step):
    """Data-parallel state: model and optimizer equal on every rank, RNG and loader state per rank."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(3000, generator=g), "b": torch.randn(8, generator=g).bfloat16()},
        "optimizer": {"m": torch.randn(3000, generator=g)},
        "rng": torch.full((16,), 10 * step + rank, dtype=torch.uint8),
        "loader": {"cursor": 10 * rank + step},
    }


def test_shared_replicas_ranks_with_their_own_state_write_all_of_it(tmp_path):
    world, results = 2, {}

    def rank_main(rank, barrier):  # islands of a DiLoCo job between syncs: nothing in common
        store = CheckpointStore(
            tmp_path, rank=rank, world_size=world, barrier=barrier.wait, clean=rank == 0, share_replicas=True
        )
        barrier.wait()
        results[rank] = store.save(replica_tree(rank, 10 + rank), 1)

    assert _ranks(world, rank_main) == []
    assert results[1].tensors_shared == 0 and results[1].tensors_written == 4
    store = CheckpointStore(tmp_path)
    for rank in range(world):
        assert_trees_equal(store.load(rank=rank).tree, replica_tree(rank, 10 + rank))


def test_shared_replicas_are_written_once_and_every_rank_loads_its_own_state(tmp_path):
    world, results = 3, {}

    def rank_main(rank, barrier):
        store = CheckpointStore(
            tmp_path,
            rank=rank,
            world_size=world,
            barrier=barrier.wait,
            clean=rank == 0,
            keep_last=1,
            share_replicas=True,
        )
        barrier.wait()
        for step, seed in ((1, 1), (2, 2), (3, 2)):  # step 3 saves step 2's state again
            results[(rank, step)] = store.save(replica_tree(rank, seed), step)

    assert _ranks(world, rank_main) == []
    store = CheckpointStore(tmp_path)
    assert store.steps() == [2, 3] and store.verify(2) == store.verify(3) == []  # 3 points into 2: kept
    assert sorted(p.name for p in store.path_for(3).iterdir()) == sorted(  # the hash list was transient
        f"rank{r:05d}.{kind}" for r in range(world) for kind in ("data", "manifest.json")
    )
    for rank in range(world):
        assert_trees_equal(store.load(rank=rank).tree, replica_tree(rank, 2))
    replicated = (3000 + 3000) * 4 + 8 * 2
    assert results[(0, 1)].tensors_shared == 0 and results[(0, 1)].tensors_written == 4
    for rank in (1, 2):
        r = results[(rank, 1)]
        assert (r.tensors_shared, r.bytes_shared, r.tensors_written) == (3, replicated, 1)  # only its rng
        assert results[(rank, 2)].tensors_shared == 3  # new replicas: taken from rank 0's step 2 part
        assert results[(rank, 3)].tensors_deduped == 4 and results[(rank, 3)].tensors_shared == 0
    # rank 0's data file holds the replicas, the others' hold 16 bytes of state each (plus blob headers)
    sizes = {r: (store.path_for(2) / data_name(r)).stat().st_size for r in range(world)}
    assert sizes[0] > 20_000 and sizes[1] < 200 and sizes[2] < 200, sizes
    from islands.checkpoint.cli import inspect

    _, table = inspect(store.path_for(2), rank=1)  # `islands ckpt inspect` says where each tensor lies
    assert sorted(table.columns[5]._cells) == ["this"] + ["this, rank00000.data"] * 3
    # a replica is checked where it lies: damage rank 0's file and rank 1's load refuses it too
    data = store.path_for(2) / data_name(0)
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpoint, match=re.escape("rank00000.data")):
        store.load(3, rank=1)


@pytest.mark.parametrize("phase", ["replica_hashes", "replica_entries"])
@pytest.mark.parametrize("dies", [0, 1])
def test_shared_replicas_a_rank_dying_in_either_exchange_leaves_the_last_checkpoint(tmp_path, phase, dies):
    world = 2

    def first(rank, barrier):
        store = CheckpointStore(
            tmp_path, rank=rank, world_size=world, barrier=barrier.wait, clean=rank == 0, share_replicas=True
        )
        barrier.wait()
        store.save(replica_tree(rank, 1), 1)

    assert _ranks(world, first) == []

    def crash(now):
        if now == phase:
            raise RuntimeError("killed")

    def second(rank, barrier):
        store = CheckpointStore(
            tmp_path,
            rank=rank,
            world_size=world,
            barrier=barrier.wait,
            clean=False,
            share_replicas=True,
            fault_hook=crash if rank == dies else None,
        )
        barrier.wait()
        store.save(replica_tree(rank, 2), 2)

    errors = _ranks(world, second)
    assert {rank for rank, _ in errors} == {0, 1}  # one died, the other's barrier broke: nothing committed
    store = CheckpointStore(tmp_path)  # reopening cleans the partial step 2
    assert store.latest_step() == 1 and store.steps() == [1]
    for rank in range(world):
        assert_trees_equal(store.load(rank=rank).tree, replica_tree(rank, 1))


def test_a_damaged_latest_falls_back_within_its_own_run_before_an_abandoned_timelines_steps(tmp_path):
    first = CheckpointStore(tmp_path, keep_last=5)
    for step in (2, 4, 8):  # the first run's checkpoints
        first.save({"w": torch.full((100,), float(step))}, step)
    resumed = CheckpointStore(tmp_path, keep_last=5)  # a run resumed from step 2 reaches step 6
    resumed.save({"w": torch.full((100,), 6.5)}, 6)
    assert resumed.latest_step() == 6
    data = tmp_path / "step-000006" / data_name(0)
    data.write_bytes(b"\0" * data.stat().st_size)
    loaded = CheckpointStore(tmp_path).load()
    # step 4 of the resumed run's past, not step 8 of the timeline it left
    assert loaded.step == 4 and [d for d, _ in loaded.skipped] == ["step-000006"]


def test_retention_counts_a_resumed_runs_own_steps_not_the_abandoned_timelines(tmp_path):
    first = CheckpointStore(tmp_path, keep_last=2)
    for step in (2, 4, 6, 8):
        first.save({"w": torch.full((100,), float(step))}, step)
    assert first.steps() == [6, 8]
    resumed = CheckpointStore(tmp_path, keep_last=2)  # resumed from step 6's predecessor state...
    resumed.save({"w": torch.full((100,), 3.0)}, 3)
    resumed.save({"w": torch.full((100,), 5.0)}, 5)
    # ...keeps its own two newest (3 and 5: 8 and 6 do not take their places) and leaves 6 and 8
    assert resumed.steps() == [3, 5, 6, 8]
    data = tmp_path / "step-000005" / data_name(0)
    data.write_bytes(b"\0" * data.stat().st_size)
    assert CheckpointStore(tmp_path).load().step == 3  # its fallback survived retention
    from islands.checkpoint.cli import ls

    rows, _ = ls(tmp_path)  # `islands ckpt ls` says which steps are past latest
    assert [("past latest" in r["status"]) for r in rows] == [False, False, True, True]
    resumed.save({"w": torch.full((100,), 7.0)}, 7)  # past 6: step 6 now counts like its own
    assert resumed.steps() == [6, 7, 8]


def test_a_resumed_run_resaving_later_steps_never_points_at_the_data_it_replaces(tmp_path):
    # the first run saved steps 2 and 4; a second run resumed from step 2 (a new store object: it has
    # not loaded anything itself, so `latest`, step 4, is its newest manifest) and saves 3 and then 4 with
    # bitwise the same state. Both must stay loadable: deduping against step 4's files, which the
    # re-save of step 4 replaces, had left both pointing at deleted data (and no intact step 4).
    w, g = torch.randn(2000), torch.Generator().manual_seed(1)
    first = CheckpointStore(tmp_path, keep_last=5)
    first.save({"w": w + 1, "n": torch.zeros(3)}, 2)
    first.save({"w": w, "n": torch.ones(3)}, 4)
    again = CheckpointStore(tmp_path, keep_last=5)
    again.save({"w": w, "n": torch.randn(3, generator=g)}, 3)
    result = again.save({"w": w, "n": torch.ones(3)}, 4)
    assert result.tensors_deduped == 1  # w, against step 3: this run's own
    store = CheckpointStore(tmp_path)
    assert store.latest_step() == 4 and all(store.verify(s) == [] for s in store.steps())
    assert torch.equal(store.load().tree["w"], w) and torch.equal(store.load(3).tree["w"], w)


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointStore(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="barrier"):
        CheckpointStore(tmp_path, rank=0, world_size=2)
    with pytest.raises(TypeError, match="allowed"):
        CheckpointStore(tmp_path).save({"x": object()}, 1)
