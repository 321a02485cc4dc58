"""Exact resume through the trainer: single process, 2 gloo ranks via the real launcher, resharding 2 -> 1,
levels and the auto interval policy in run.json, and a foreign model config refused with exit code 2."""

import json
import threading
from pathlib import Path

import pytest
import torch

from harness.cli import EXACT, TINY, TINY_FLAGS, islands_cli, resume_at, run, same, trainer
from islands.app.build import fingerprint
from islands.app.validate import validate
from islands.checkpoint import CheckpointMismatch, CheckpointStore
from islands.checkpoint.store.manifest import data_name
from islands.config import ConfigError, from_mapping


def test_single_process_resume_is_bitwise_and_checkpointing_changes_nothing(tmp_path):
    plain = run(trainer(tmp_path, "plain", steps=8))
    a = trainer(tmp_path, "a", steps=8, ckpt_every=4, ckpt_dir=str(tmp_path / "ca"))
    rec_a = run(a)
    b = trainer(
        tmp_path, "b", steps=8, ckpt_every=4, ckpt_dir=str(tmp_path / "cb"), resume=str(tmp_path / "ca" / "step-000004")
    )
    info = resume_at(b, tmp_path / "ca" / "step-000004")
    assert info["step"] == 4 and b.step == 4 and not info["resharded"]
    rec_b = run(b)
    ta = CheckpointStore(tmp_path / "ca", clean=False).load(8).tree
    tb = CheckpointStore(tmp_path / "cb", clean=False).load(8).tree
    for key in EXACT:
        assert same(ta[key], tb[key]), key
    assert ta["config_fingerprint"] == json.dumps(a.job.fingerprint_fields(), sort_keys=True) == fingerprint(a.job)
    # checkpointing does not perturb training: same final loss bit for bit as a run without it
    assert (
        plain["summary"]["final_val_loss"] == rec_a["summary"]["final_val_loss"] == rec_b["summary"]["final_val_loss"]
    )
    assert rec_a["checkpoint"]["saves"] == {"local": 2} and rec_a["checkpoint"]["policy"] == "fixed"
    # the staging buffers were made after step 1, ahead of the first save (step 4), which copied into them
    assert rec_a["checkpoint"]["staging_reserve_s"] is not None
    assert rec_b["checkpoint"]["resumed_from"]["step"] == 4
    # a torn newer checkpoint is skipped: resume from the root falls back to step 4
    data = tmp_path / "ca" / "step-000008" / "rank00000.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    c = trainer(tmp_path, "c", steps=8)
    info = resume_at(c, tmp_path / "ca")
    assert info["step"] == 4 and "checksum" in info["skipped"][0]["why"]


def test_resume_from_a_root_follows_latest_not_an_abandoned_timelines_newer_steps(tmp_path):
    root = tmp_path / "ck"
    run(trainer(tmp_path, "a", steps=8, ckpt_every=2, ckpt_dir=str(root), ckpt_keep=10))  # steps 2..8
    b = trainer(tmp_path, "b", steps=5, ckpt_every=2, ckpt_dir=str(root), ckpt_keep=10)
    resume_at(b, root / "step-000002")  # back to step 2, into the same directory
    run(b)  # saves step 4 again and, at its end, step 5: `latest` is 5
    store = CheckpointStore(root, clean=False)
    assert store.latest_step() == 5 and store.steps() == [2, 4, 5, 6, 8]
    assert all(store.verify(s) == [] for s in store.steps())  # step 4's re-save points at no replaced data
    c = trainer(tmp_path, "c", steps=8)
    info = resume_at(c, root)
    assert info["step"] == 5 and c.step == 5  # not step 8 of the run b left behind
    assert b.checkpoints.restore().step == 5  # nor in-process, across the levels


def test_levels_memory_remote_and_auto_policy_recorded(tmp_path):
    t = trainer(
        tmp_path,
        "run",
        steps=9,
        ckpt_policy="auto:first=2,mtbf_days=0.00002",
        ckpt_memory_every=1,
        ckpt_remote_dir=str(tmp_path / "remote"),
        ckpt_remote_every=3,
    )
    rec = run(t)
    ck = rec["checkpoint"]
    assert ck["levels"] == {"memory": 1, "local": "policy", "remote": 3}
    assert ck["staging_reserve_s"] is None  # a save was due at step 1: nothing to make ahead of it
    assert ck["decisions"] and all(d["reason"] and d["binding"] for d in ck["decisions"])
    assert ck["decision"]["interval_steps"] >= 1 and ck["saves"]["local"] >= 2
    on_disk = json.loads((tmp_path / "run" / "run.json").read_text())["checkpoint"]
    assert on_disk["decision"]["reason"] == ck["decision"]["reason"]
    assert CheckpointStore(tmp_path / "remote", clean=False).steps() == [3, 6, 9]
    assert CheckpointStore(tmp_path / "run" / "ckpt", clean=False).latest_step() == 9
    restored = t.checkpoints.restore()
    assert restored.step == 9 and restored.level == "memory"  # newest, and memory wins the tie
    assert torch.equal(
        restored.tree["model"]["head.weight"]
        if "head.weight" in restored.tree["model"]
        else next(iter(restored.tree["model"].values())),
        t.model.state_dict()["head.weight"]
        if "head.weight" in restored.tree["model"]
        else next(iter(t.model.state_dict().values())),
    )
    # local damaged at step 9 -> resume takes the remote level's step 9
    for f in (tmp_path / "run" / "ckpt" / "step-000009").glob("*.data"):
        f.write_bytes(b"\0" * f.stat().st_size)
    r = trainer(tmp_path, "r", steps=9, ckpt_remote_dir=str(tmp_path / "remote"), ckpt_remote_every=3)
    info = resume_at(r, tmp_path / "run" / "ckpt")
    assert (info["level"], info["step"]) == ("remote", 9)


def test_foreign_model_config_refused_naming_the_field(tmp_path, capsys):
    run(trainer(tmp_path, "a", steps=2, ckpt_every=2))
    with pytest.raises(ConfigError, match=r"d_model: checkpoint 32, current 64"):
        validate(from_mapping({**TINY, "d_model": 64, "resume": str(tmp_path / "a")}))
    bad = trainer(tmp_path, "b", steps=2, n_layers=2)
    with pytest.raises(CheckpointMismatch, match="n_layers"):
        resume_at(bad, tmp_path / "a")
    capsys.readouterr()
    code = islands_cli(
        "train",
        *TINY_FLAGS,
        "--workers",
        "1",
        "--steps",
        "2",
        "--n-heads",
        "4",
        "--resume",
        str(tmp_path / "a"),
        "--run-dir",
        str(tmp_path / "x"),
    )
    out = capsys.readouterr()
    assert code == 2, out.err
    assert "n_heads: checkpoint 2, current 4" in out.err + out.out and not (tmp_path / "x").exists()
    with pytest.raises(ConfigError, match=r"chooses the local-disk interval itself; leave every=0 \(got every=5\)"):
        validate(from_mapping({**TINY, "ckpt_every": 5, "ckpt_policy": "auto"}))
    with pytest.raises(ConfigError, match="remote_dir and remote_every go together"):
        validate(from_mapping({**TINY, "ckpt_remote_every": 5}))
    with pytest.raises(ConfigError, match=r"checkpoint policy auto does not take bund \(did you mean bound\?\)"):
        validate(from_mapping({**TINY, "ckpt_policy": "auto:bund=0.1"}))


def _launch(tmp: Path, name: str, *extra: str) -> dict:
    code = islands_cli(
        "train",
        *TINY_FLAGS,
        "--workers",
        "2",
        "--steps",
        "6",
        "--ckpt-every",
        "3",
        "--no-probe",
        "--timeout",
        "30",
        "--run-dir",
        str(tmp / name),
        *extra,
        timeout=240,
    )
    assert code == 0, "".join(p.read_text() for p in (tmp / name / "logs").glob("*.log"))
    return json.loads((tmp / name / "run.json").read_text())


@pytest.mark.slow  # two launcher jobs of 2 rank processes each (the launcher runs in this process)
def test_two_gloo_ranks_resume_bitwise_and_reshard_to_one(tmp_path):
    rec_a = _launch(tmp_path, "a")
    rec_b = _launch(tmp_path, "b", "--resume", str(tmp_path / "a" / "ckpt" / "step-000003"))
    assert rec_b["checkpoint"]["resumed_from"]["step"] == 3
    assert rec_a["summary"]["final_val_loss"] == rec_b["summary"]["final_val_loss"]
    sa, sb = (
        CheckpointStore(tmp_path / "a" / "ckpt", clean=False),
        CheckpointStore(tmp_path / "b" / "ckpt", clean=False),
    )
    for rank in (0, 1):
        ta, tb = sa.load(6, rank=rank).tree, sb.load(6, rank=rank).tree
        for key in EXACT:
            assert same(ta[key], tb[key]), (rank, key)
    r0, r1 = sa.load(6, rank=0).tree, sa.load(6, rank=1).tree
    assert not same(r0["loader"], r1["loader"]) or r0["world"]["rank"] != r1["world"]["rank"]
    # ddp replicas are written once: rank 1's part holds only what differs (its RNG and loader state)
    assert rec_a["checkpoint"]["share_replicas"] and rec_a["checkpoint"]["disk_bytes_this_rank"]["written"] > 0
    size = {r: (sa.path_for(6) / data_name(r)).stat().st_size for r in (0, 1)}
    assert size[1] < size[0] / 10, size
    assert same(r0["model"], r1["model"]) and same(r0["optimizer"], r1["optimizer"])
    # 2 saved ranks -> 1 process: replicated ddp state loads; loader by the mean-progress policy
    one = trainer(tmp_path, "one", steps=6)
    info = resume_at(one, tmp_path / "a" / "ckpt" / "step-000003")
    assert info["resharded"] and info["saved_world_size"] == 2 and one.step == 3
    saved = sa.load(3, rank=0).tree
    assert same(one.model.state_dict(), saved["model"])
    progress = [sa.load(3, rank=r).tree for r in (0, 1)]
    mean = sum(t["loader"]["epoch"] + t["loader"]["cursor"] / t["world"]["shard_items"] for t in progress) / 2
    own = one.data.sampler
    assert own.epoch == int(mean) and abs(own.cursor - round((mean - int(mean)) * own.n)) <= 1


def test_per_rank_state_is_not_resharded(tmp_path):
    gate = threading.Barrier(2, timeout=20)
    stores = [CheckpointStore(tmp_path, rank=r, world_size=2, barrier=gate.wait) for r in (0, 1)]
    t = trainer(tmp_path, "t", steps=2)
    base = {
        "config_fingerprint": fingerprint(t.job),
        "world": {"rank": 0, "size": 2, "shard_items": 10},
        **t.state_dict(),
    }
    trees = [dict(base, strategy={"error": torch.full((3,), float(r))}) for r in (0, 1)]
    threads = [threading.Thread(target=stores[r].save, args=(trees[r], 5)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    with pytest.raises(CheckpointMismatch, match=r"'strategy/error' differs between saved ranks 0 and 1"):
        resume_at(t, tmp_path)
