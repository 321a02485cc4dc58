"""`islands bench --reuse`: a finished run with the same config is read back, anything else runs."""

import json

import pytest

import islands.app.launch as launch_mod
from islands_bench.harness import BenchContext


def _ctx(tmp_path, reuse=True):
    return BenchContext(name="x", quick=True, out_dir=tmp_path, reuse=reuse)


def _leave_finished_run(ctx, label, **overrides):
    cfg = ctx.config(**overrides)
    cfg.output.run_dir = "/elsewhere/it/ran"  # where a run ran is not part of its identity
    run_dir = ctx.out_dir / "runs" / label
    run_dir.mkdir(parents=True)
    record = {"config": cfg.to_dict(), "summary": {"final_val_loss": 1.25}}
    (run_dir / "run.json").write_text(json.dumps(record))


@pytest.fixture
def launches(monkeypatch):
    calls = []

    def fake_launch(cfg, run_dir):
        calls.append(cfg)
        (run_dir).mkdir(parents=True, exist_ok=True)
        (run_dir / "run.json").write_text(json.dumps({"config": cfg.to_dict(), "summary": {"final_val_loss": 9.0}}))
        return 0

    monkeypatch.setattr(launch_mod, "launch", fake_launch)
    return calls


def test_a_finished_run_with_the_same_config_is_read_not_run(tmp_path, launches):
    ctx = _ctx(tmp_path)
    _leave_finished_run(ctx, "ddp", task="digits", steps=30, workers=2)
    rec = ctx.train("ddp", task="digits", steps=30, workers=2)
    assert launches == [] and rec["summary"]["final_val_loss"] == 1.25 and rec["label"] == "ddp"
    assert ctx.runs == [rec]


def test_a_different_config_or_no_reuse_runs_again(tmp_path, launches):
    ctx = _ctx(tmp_path)
    _leave_finished_run(ctx, "ddp", task="digits", steps=30, workers=2)
    assert ctx.train("ddp", task="digits", steps=31, workers=2)["summary"]["final_val_loss"] == 9.0
    assert len(launches) == 1
    other = tmp_path / "other"
    fresh = _ctx(other, reuse=False)
    _leave_finished_run(fresh, "ddp", task="digits", steps=30, workers=2)
    assert fresh.train("ddp", task="digits", steps=30, workers=2)["summary"]["final_val_loss"] == 9.0
    assert len(launches) == 2


def test_progress_bars_and_keys_a_record_predates_do_not_force_a_rerun(tmp_path, launches):
    ctx = _ctx(tmp_path)
    _leave_finished_run(ctx, "ddp", task="digits", steps=30, workers=2, progress=True)  # islands train's default
    path = tmp_path / "runs" / "ddp" / "run.json"
    record = json.loads(path.read_text())
    del record["config"]["inner"]["overlap"]  # written before the key existed: it ran as its default does
    path.write_text(json.dumps(record))
    assert ctx.train("ddp", task="digits", steps=30, workers=2)["summary"]["final_val_loss"] == 1.25
    assert launches == []
    # a missing key whose wanted value is not its default is a different run
    assert ctx.train("ddp", task="digits", steps=30, workers=2, hook_overlap=False)["summary"]["final_val_loss"] == 9.0
    assert len(launches) == 1


def test_a_record_with_the_flat_config_of_before_the_sections_is_still_read(tmp_path, launches):
    ctx = _ctx(tmp_path)
    run_dir = tmp_path / "runs" / "ddp"
    run_dir.mkdir(parents=True)
    flat = {
        "task": "digits",
        "steps": 30,
        "workers": 2,
        "compress": "none",
        "hook_overlap": True,
        "extra": {},
        "run_dir": "/elsewhere",
        "progress": True,
    }
    (run_dir / "run.json").write_text(json.dumps({"config": flat, "summary": {"final_val_loss": 1.5}}))
    assert ctx.train("ddp", task="digits", steps=30, workers=2)["summary"]["final_val_loss"] == 1.5
    assert launches == []
    flat["no_such_key"] = 1  # a key islands no longer knows: not the same run
    (run_dir / "run.json").write_text(json.dumps({"config": flat, "summary": {"final_val_loss": 1.5}}))
    assert ctx.train("ddp", task="digits", steps=30, workers=2)["summary"]["final_val_loss"] == 9.0
