"""FSDP (inner=fsdp) checkpoints: bitwise resume on the same world size and loading into another one.

The optimizer state is stored full and keyed by parameter name (islands.checkpoint.policy.sharded_state), so
a checkpoint of N ranks loads on M: each rank takes its own rows. Runs go through the real launcher (started from
this process: islands_cli)."""

import json
from pathlib import Path

import pytest
import torch

from harness.cli import EXACT, TINY_FLAGS, islands_cli, resume_at, same, trainer
from islands.checkpoint import CheckpointStore

FSDP_FLAGS = [
    *TINY_FLAGS,
    "--inner",
    "fsdp",
    "--n-layers",
    "2",
    "--steps",
    "6",
    "--ckpt-every",
    "3",
    "--no-probe",
    "--timeout",
    "30",
]


def _launch(tmp: Path, name: str, workers: int, *extra: str) -> dict:
    code = islands_cli("train", *FSDP_FLAGS, "--workers", str(workers), "--run-dir", str(tmp / name), *extra)
    logs = "".join(p.read_text() for p in (tmp / name / "logs").glob("*.log")) if (tmp / name / "logs").is_dir() else ""
    assert code == 0, logs[-6000:]
    return json.loads((tmp / name / "run.json").read_text())


def _store(tmp: Path, name: str) -> CheckpointStore:
    return CheckpointStore(tmp / name / "ckpt", clean=False)


def _full_and_named(tree: dict) -> None:
    """The stored optimizer state is the whole of every tensor, keyed by parameter name."""
    model, opt = tree["model"], tree["optimizer"]
    assert set(opt["state"]) == {k for k in model if k in opt["state"]} and opt["state"]
    for name, slots in opt["state"].items():
        assert slots["exp_avg"].shape == model[name].shape, name
        assert slots["exp_avg_sq"].abs().sum() > 0, name


def _continues(rec: dict, resumed_step: int, saved_size: int, size: int) -> None:
    frm = rec["checkpoint"]["resumed_from"]
    assert (frm["step"], frm["saved_world_size"], frm["world_size"]) == (resumed_step, saved_size, size)
    assert frm["resharded"] == (saved_size != size)
    assert rec["summary"]["steps"] == 6 and rec["series"]["val"][-1]["val_loss"] < 10
    for ledger in rec["comm"]["per_rank"]:
        assert ledger["sent"]["ckpt_shard_gather"] > 0  # the optimizer gather went through Comm


@pytest.mark.slow  # four launcher jobs (2, 2, 4 and 2 rank processes) and one in-process load
def test_fsdp_resume_bitwise_and_load_on_one_two_and_four_ranks(tmp_path):
    """One 2-rank run serves three checks: bitwise resume on 2, loading into 1 process, and into 4; the 4-rank job
    then serves the fourth, loading a checkpoint of 4 ranks into 2."""
    rec_a = _launch(tmp_path, "a", 2)
    rec_b = _launch(tmp_path, "b", 2, "--resume", str(tmp_path / "a" / "ckpt" / "step-000003"))
    _continues(rec_b, 3, 2, 2)
    assert rec_a["summary"]["final_val_loss"] == rec_b["summary"]["final_val_loss"]
    sa, sb = _store(tmp_path, "a"), _store(tmp_path, "b")
    for rank in (0, 1):
        ta, tb = sa.load(6, rank=rank).tree, sb.load(6, rank=rank).tree
        _full_and_named(ta)
        for key in EXACT:
            assert same(ta[key], tb[key]), (rank, key)
    # replicated parts: both saved ranks hold the same full model and optimizer state
    t0, t1 = sa.load(3, rank=0).tree, sa.load(3, rank=1).tree
    assert same(t0["model"], t1["model"]) and same(t0["optimizer"], t1["optimizer"])
    # 2 saved ranks -> one process (no FSDP): name-keyed state loads into a plain optimizer
    one = trainer(tmp_path, "one", n_layers=2, steps=6, inner="fsdp")
    info = resume_at(one, tmp_path / "a" / "ckpt" / "step-000003")
    assert info["resharded"] and one.step == 3
    assert same(one.model.state_dict(), t0["model"])
    names = dict((id(p), n) for n, p in one.model.named_parameters())
    for p, slots in one.optimizer.state.items():
        assert torch.equal(slots["exp_avg"], t0["optimizer"]["state"][names[id(p)]]["exp_avg"])
    # 2 saved ranks -> 4 (saving every 2 steps: 4 and 6), and its 4-rank checkpoint at step 4 -> 2
    rec = _launch(
        tmp_path, "two_to_four", 4, "--resume", str(tmp_path / "a" / "ckpt" / "step-000003"), "--ckpt-every", "2"
    )
    _continues(rec, 3, 2, 4)
    rec = _launch(tmp_path, "four_to_two", 2, "--resume", str(tmp_path / "two_to_four" / "ckpt" / "step-000004"))
    _continues(rec, 4, 4, 2)
    saved = _store(tmp_path, "two_to_four").load(4, rank=0).tree
    # the resumed job's next checkpoint starts from the loaded state: step 6 differs from 4 but keeps its names
    after = _store(tmp_path, "four_to_two").load(6, rank=1).tree
    assert set(after["optimizer"]["state"]) == set(saved["optimizer"]["state"])
    assert int(after["step"]) == 6
