"""Elastic jobs checkpoint through the trainer's driver and resume (issue #4: "Resume restores
outer-optimizer and membership state"). Two workers, digits, DiLoCo with outer Nesterov momentum."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from islands.checkpoint import CheckpointStore
from islands.checkpoint.elastic_saves import ElasticBarrier, MembershipChanged
from islands.config import ConfigError, from_mapping, validate
from islands.runtime.elastic_launch import launch_elastic

from test_checkpoint_resume import same


def _cfg(run: Path, **extra):
    return validate(from_mapping({**dict(task="digits", workers=2, islands=2, outer="diloco:inner_steps=2",
                                         elastic=True, steps=8, global_batch=16, eval_every=0, warmup=2,
                                         probe=False, progress=False, timeout=30.0, heartbeat_timeout=5.0,
                                         ckpt_every=4, run_dir=str(run)), **extra}))


def _launch(run: Path, **extra) -> None:
    out = io.StringIO()
    code = launch_elastic(_cfg(run, **extra), run, out=out)
    logs = "".join(p.read_text()[-2000:] for p in (run / "logs").glob("*.log"))
    assert code == 0, out.getvalue() + logs


def _by_shard(root: Path, step: int) -> dict[int, dict]:
    store = CheckpointStore(root, clean=False)
    trees = [store.load(step, rank=r).tree for r in range(2)]
    return {t["world"]["shard"]: t for t in trees}


@pytest.mark.slow  # two elastic jobs of 2 workers: ~30 s on an idle 2-core machine
def test_elastic_resume_restores_outer_optimizer_and_membership_bitwise(tmp_path):
    _launch(tmp_path / "a")
    saved = _by_shard(tmp_path / "a" / "ckpt", 4)
    assert sorted(saved) == [0, 1]
    momentum = saved[0]["strategy"]["outer"]["outer_opt"]["momentum_buffer"]
    assert momentum.abs().sum() > 0  # outer Nesterov momentum after two rounds: state worth restoring
    members = saved[0]["membership"]["members"]
    assert [m[1] for m in members] and saved[0]["membership"]["epoch"] == 0

    _launch(tmp_path / "b", resume=str(tmp_path / "a" / "ckpt" / "step-000004"))
    a8, b8 = _by_shard(tmp_path / "a" / "ckpt", 8), _by_shard(tmp_path / "b" / "ckpt", 8)
    for shard in (0, 1):  # resumed = uninterrupted, bit for bit: outer optimizer, models, inner optimizer, data
        for key in ("strategy", "model", "optimizer", "loader", "rng", "step"):
            assert same(a8[shard][key], b8[shard][key]), (shard, key)
    rec = json.loads((tmp_path / "b" / "run.json").read_text())
    frm = rec["checkpoint"]["resumed_from"]
    assert frm["step"] == 4 and frm["elastic"] and frm["shard_matched"]
    assert rec["checkpoint"]["saves"]["local"] == 1 and rec["checkpoint"]["abandoned_membership_change"] == []
    # membership: epochs count on from the saved one; the saved history plus a "resumed" event
    for worker in (tmp_path / "b" / "elastic").glob("*.json"):
        final = json.loads(worker.read_text())["final"]
        assert final["epoch"] == saved[0]["membership"]["epoch"] + 1
        resumed = [e for e in final["events"] if e["type"] == "resumed"]
        assert resumed == [{"type": "resumed", "from_epoch": 0, "previous_members": members}]
    b_members = b8[0]["membership"]
    assert b_members["epoch"] == 1 and b_members["events"][-1]["type"] == "resumed"


def test_elastic_checkpoint_settings_that_cannot_work_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="fixed checkpoint interval"):
        _cfg(tmp_path, ckpt_every=0, ckpt_policy="auto")
    with pytest.raises(ConfigError, match="ckpt_memory_peer"):
        _cfg(tmp_path, ckpt_memory_every=2, ckpt_memory_peer=True)


class _Membership:
    epoch = 3


class _World:
    def __init__(self):
        self.membership, self.gathers = _Membership(), 0

    def all_gather_object(self, obj):
        self.gathers += 1
        if self.gathers == 1:
            self.membership.epoch = 4  # a member died during the first gather: the survivors re-formed
        return [obj]


def test_barrier_abandons_a_save_only_before_the_commit():
    world = _World()
    barrier = ElasticBarrier(world)
    assert barrier.begin() == 3
    with pytest.raises(MembershipChanged, match="epoch 3 -> 4"):
        barrier()
    barrier.begin()  # epoch 4 now
    barrier()  # same epoch: passes
    world.membership.epoch = 5
    barrier()  # second call of a save: the commit happened, nothing to abandon
    assert world.gathers == 3  # every call met the others
