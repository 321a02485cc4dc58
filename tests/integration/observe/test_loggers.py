"""Experiment loggers (islands.observe): what each backend wrote, read back with that backend's own reader,
equals the run record (run.json) — train and val losses at their steps, every collective kind's bytes, the
interconnect and baseline as parameters, checkpoint saves — per rank; and `--log` refuses unknown names."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import islands
from harness.cli import islands_cli
from harness.flags import tiny
from islands.app.validate import validate
from islands.checkpoint.policy.driver import CheckpointDriver
from islands.checkpoint.policy.settings import CheckpointSettings
from islands.cli import main
from islands.config import ConfigError, from_mapping
from islands.observe import JsonLines, Logging, MLflow, TensorBoard, Wandb, read_lines
from islands.observe.mlflow import mlflow_key

STEPS, LOG_EVERY, EVAL_EVERY, CKPT_EVERY = 12, 2, 4, 5
KINDS = ("grad_all_reduce", "outer:delta")  # the second has a character MLflow refuses in a name


class Traffic:
    """Stands in for a strategy's collectives in a one-process run: bytes into the world's ledger each step, as
    islands.runtime.comm records them (an odd kind every third step, so kinds and per-step bytes differ)."""

    order = 5

    def on_step_end(self, trainer, loss: float) -> None:
        trainer.world.ledger.record(KINDS[0], 4096 + trainer.step, 4096)
        if trainer.step % 3 == 0:
            trainer.world.ledger.record(KINDS[1], 1000 * trainer.step, 0)


def tb_reader(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def tb_params(ea) -> dict:
    """The "params" text (a Markdown table) back as a dict of strings."""
    text = ea.Tensors("params/text_summary")[0].tensor_proto.string_val[0].decode()
    rows = [row[2:-2].split(" | ", 1) for row in text.splitlines()[2:]]
    return {k: v.replace("\\|", "|") for k, v in rows}


def wandb_records(path: Path):
    """The protobuf records of a W&B run file (<run>/run-<id>.wandb), read by its framing: a 7-byte file header
    (":W&B", magic, version), then 32 KiB blocks of chunks, each with a 7-byte header (checksum, length, type:
    1 whole, 2 first, 3 middle, 4 last); a block's tail shorter than a header is padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, head = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", data[:7]
    pos, pending = head, b""
    while pos + head <= len(data):
        left = block - pos % block
        if left < head:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + head])
        chunk, pos = data[pos + head : pos + head + length], pos + head + length
        if kind == 0:  # zero fill to the block's end
            pos += left - head
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def wandb_run(root: Path) -> dict:
    """History rows, config and run metadata of the one offline run under root/wandb."""
    files = sorted(root.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    out: dict = {"history": [], "config": {}, "summary": {}}
    for r in wandb_records(files[0]):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
        elif kind == "run":
            out["name"], out["group"] = r.run.display_name, r.run.run_group
            out["config"].update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "summary":
            out["summary"].update({i.key: json.loads(i.value_json) for i in r.summary.update})
    return out


def series_of(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(int(row["step"]), row[key]) for row in rows if key in row]


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """One process, a 2-layer MLP on random data, every backend at once, a checkpoint every 5 steps."""
    root = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(STEPS)]
    world = islands.World.single()
    loggers = [
        JsonLines(root / "live" / "rank0.jsonl"),
        TensorBoard(root / "tb" / "rank0"),
        MLflow(root / "mlruns", experiment="job-a", run_name="rank0", tags={"islands.stream": "rank0"}),
        Wandb(root, project="islands-test", group="job-a", name="rank0"),
    ]
    driver = CheckpointDriver(CheckpointSettings(every=CKPT_EVERY, asynchronous=False), world, root)
    trainer = islands.Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        F.cross_entropy,
        data,
        val_data=data[:2],
        world=world,
        log_every=LOG_EVERY,
        callbacks=[
            islands.Evaluate(every=EVAL_EVERY),
            Traffic(),
            islands.Checkpointing(driver),
            islands.RunRecord(root, config={"train": {"lr": 1e-2, "steps": STEPS}}),
            Logging(loggers, params={"stream": "rank0"}),
        ],
    )
    trainer.fit(STEPS)
    import wandb

    wandb.teardown()  # the service process this test started
    return root, json.loads((root / "run.json").read_text()), loggers[2]


def test_tensorboard_reads_back_the_run_record(logged):
    root, rec, _ = logged
    ea = tb_reader(root / "tb" / "rank0")
    train = [(e["step"], pytest.approx(e["loss"], rel=1e-6)) for e in rec["series"]["train"]]
    val = [(e["step"], pytest.approx(e["val_loss"], rel=1e-6)) for e in rec["series"]["val"]]
    assert [(s.step, s.value) for s in ea.Scalars("train/loss")] == train
    assert [(s.step, s.value) for s in ea.Scalars("val/loss")] == val
    assert [s.step for s in ea.Scalars("val/loss")] == [0, 4, 8, 12]
    sent = rec["comm"]["per_rank"][0]["sent"]
    assert set(sent) == set(KINDS)
    for kind, total in sent.items():
        assert ea.Scalars(f"comm/sent_bytes/{kind}")[-1].value == pytest.approx(total, rel=1e-6), kind
    assert {"train/lr", "train/tokens_per_s", "time/utilisation", "time/blocked_s"} <= set(ea.Tags()["scalars"])
    params = tb_params(ea)
    assert params["interconnect"] == rec["interconnect_line"]
    assert params["baseline"] == rec["baseline"]["definition"]
    assert params["config.train.steps"] == str(STEPS) and params["stream"] == "rank0"


def test_mlflow_reads_back_the_run_record(logged):
    from mlflow.tracking import MlflowClient

    root, rec, logger = logged
    client = MlflowClient(tracking_uri=(root / "mlruns").resolve().as_uri())  # a fresh client: only the files
    experiment = client.get_experiment_by_name("job-a")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == logger.run_id and run.info.status == "FINISHED"
    assert run.data.tags["islands.stream"] == "rank0" and run.info.run_name == "rank0"

    def history(name):
        return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))

    assert history("train/loss") == [(e["step"], e["loss"]) for e in rec["series"]["train"]]
    assert history("val/loss") == [(e["step"], e["val_loss"]) for e in rec["series"]["val"]]
    for kind, total in rec["comm"]["per_rank"][0]["sent"].items():
        assert history(mlflow_key(f"comm/sent_bytes/{kind}"))[-1][1] == total, kind
    assert mlflow_key("comm/sent_bytes/outer:delta") == "comm/sent_bytes/outer_delta"
    params = run.data.params
    assert params["interconnect"] == rec["interconnect_line"]
    assert params["baseline"] == rec["baseline"]["definition"]
    assert params["config.train.lr"] == "0.01"


def test_wandb_offline_run_reads_back_the_run_record(logged):
    root, rec, _ = logged
    run = wandb_run(root)
    assert run["name"] == "rank0" and run["group"] == "job-a"
    rows = run["history"]
    assert series_of(rows, "train/loss") == [(e["step"], e["loss"]) for e in rec["series"]["train"]]
    assert series_of(rows, "val/loss") == [(e["step"], e["val_loss"]) for e in rec["series"]["val"]]
    for kind, total in rec["comm"]["per_rank"][0]["sent"].items():
        assert series_of(rows, f"comm/sent_bytes/{kind}")[-1][1] == total, kind
    config = {k: v.get("value", v) if isinstance(v, dict) else v for k, v in run["config"].items()}
    assert config["interconnect"] == rec["interconnect_line"]
    assert config["baseline"] == rec["baseline"]["definition"]


def test_a_checkpoint_save_is_a_metric_and_an_event(logged):
    root, rec, logger = logged
    saves = rec["checkpoint"]["saves"]["local"]
    assert saves == 3  # steps 5, 10 and the final 12
    lines = read_lines(root / "live" / "rank0.jsonl")
    assert lines[0]["kind"] == "params"
    counts = [
        (ln["step"], ln["metrics"]["ckpt/saves/local"])
        for ln in lines
        if ln["kind"] == "metrics" and "ckpt/saves/local" in ln["metrics"]
    ]
    assert counts == [(5, 1), (10, 2), (12, 3)]
    events = [ln for ln in lines if ln["kind"] == "event"]
    assert [(e["step"], e["event"]["type"], e["event"]["last_saved_step"]) for e in events] == [
        (5, "checkpoint", 5),
        (10, "checkpoint", 10),
        (12, "checkpoint", 12),
    ]
    ea = tb_reader(root / "tb" / "rank0")
    assert [(s.step, s.value) for s in ea.Scalars("ckpt/saves/local")] == [(5, 1), (10, 2), (12, 3)]
    assert [t.step for t in ea.Tensors("events/checkpoint/text_summary")] == [5, 10, 12]
    artifact = Path(logger.client.download_artifacts(logger.run_id, "events.jsonl", str(root)))
    assert [json.loads(x)["step"] for x in artifact.read_text().splitlines()] == [5, 10, 12]
    rows = wandb_run(root)["history"]
    assert series_of(rows, "event/checkpoint") == [(5, 1), (10, 1), (12, 1)]


TINY = tiny(eval_batches=2, threads=1, eval_every=3, warmup=2, log_every=2, no_progress=True, no_probe=True, timeout=60)


@pytest.mark.slow  # two gloo workers through the launcher, which runs in this process
def test_two_ranks_each_log_their_own_stream(tmp_path):
    run_dir = tmp_path / "two"
    code = islands_cli(
        "train", *TINY, "--workers", "2", "--steps", "6", "--run-dir", str(run_dir), "--log", "tensorboard", timeout=240
    )
    assert code == 0, "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    rec = json.loads((run_dir / "run.json").read_text())
    assert sorted(p.name for p in (run_dir / "tb").iterdir()) == ["rank0", "rank1"]
    assert sorted(p.name for p in (run_dir / "live").iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
    for rank in (0, 1):
        sent = rec["comm"]["per_rank"][rank]["sent"]
        assert sent and sum(sent.values()) > 0
        lines = read_lines(run_dir / "live" / f"rank{rank}.jsonl")
        assert lines[0]["params"]["world.rank"] == rank and lines[0]["params"]["stream"] == f"rank{rank}"
        last = [ln["metrics"] for ln in lines if ln["kind"] == "metrics" and "comm/sent_mb" in ln["metrics"]][-1]
        assert {
            k.removeprefix("comm/sent_bytes/"): v for k, v in last.items() if k.startswith("comm/sent_bytes/")
        } == sent  # exact: JSON keeps the integer counts
        ea = tb_reader(run_dir / "tb" / f"rank{rank}")
        for kind, total in sent.items():
            assert ea.Scalars(f"comm/sent_bytes/{kind}")[-1].value == pytest.approx(total, rel=1e-6), (rank, kind)
        assert [s.step for s in ea.Scalars("train/loss")] == [e["step"] for e in rec["series"]["train"]]


def test_unknown_or_missing_logger_is_refused_before_any_worker(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        main(["train", "--run-dir", str(tmp_path / "r"), "--log", "tensorbord,mlflow"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "unknown logger 'tensorbord' (did you mean tensorboard?)" in err and "tensorboard, mlflow, wandb" in err
    assert not (tmp_path / "r").exists()
    toml = tmp_path / "job.toml"
    toml.write_text('[output]\nlog = "mlflow, wandb , mlfow"\n')
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(toml), "--run-dir", str(tmp_path / "r")])
    assert e.value.code == 2 and "did you mean mlflow?" in capsys.readouterr().err
    assert validate(from_mapping({"output.log": "TensorBoard, none,tensorboard"})).output.log  # case, none, repeats
    monkeypatch.setattr("islands.observe.backends.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"not installed: wandb \(wandb\); pip install 'islands\[loggers\]'"):
        validate(from_mapping({"log": "wandb"}))
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails as if it were not installed
    with pytest.raises(ImportError, match=r"W&B logger needs the wandb package: pip install 'islands\[loggers\]'"):
        Wandb(tmp_path)


def test_membership_changes_reach_the_loggers_as_events(tmp_path):
    """An elastic member's membership events (islands.runtime.elastic) arrive once each, at the step they were
    seen, and the final line carries no per-step rate for the step-less final synchronisation."""
    from types import SimpleNamespace

    membership = SimpleNamespace(events=[{"type": "entered", "epoch": 0, "step": 0}])
    world = SimpleNamespace(
        membership=membership,
        ledger=islands.CommLedger(),
        rank=0,
        size=2,
        islands=2,
        island=0,
        backend="gloo",
        device=torch.device("cpu"),
    )
    trainer = SimpleNamespace(
        world=world,
        series={"train": [], "val": []},
        step=0,
        elapsed=0.0,
        sync_seconds=0.0,
        comm_seconds=0.0,
        samples_per_step=4,
        checkpoints=None,
        callbacks=[],
        strategy=SimpleNamespace(name="diloco"),
        record=None,
    )
    path = tmp_path / "live" / "m1.jsonl"
    cb = Logging([JsonLines(path)])
    cb.on_fit_start(trainer)  # what happened before this fit (entering) is not logged again
    trainer.step, trainer.elapsed = 5, 1.0
    world.ledger.record("outer_delta", 800, 800)
    membership.events.append({"type": "failure", "epoch": 1, "gone": ["m2"], "stall_seconds": 0.12})
    trainer.series["train"].append({"step": 5, "loss": 2.5, "lr": 1e-3, "elapsed": 1.0, "mb_sent": 0.0008})
    cb.on_step_end(trainer, 2.5)
    cb.on_step_end(trainer, 2.5)  # nothing new: nothing logged twice
    trainer.elapsed = 1.5
    cb.on_fit_end(trainer)
    lines = read_lines(path)
    events = [ln for ln in lines if ln["kind"] == "event"]
    assert len(events) == 1 and events[0]["step"] == 5
    assert events[0]["event"]["type"] == "membership" and events[0]["event"]["change.type"] == "failure"
    assert events[0]["event"]["change.gone"] == '["m2"]'
    metrics = [ln for ln in lines if ln["kind"] == "metrics"]
    assert metrics[0]["metrics"]["comm/bytes_per_step/outer_delta"] == 800 / 5
    assert metrics[0]["metrics"]["train/tokens_per_s"] == 4 * 5 / 1.0
    final = metrics[-1]["metrics"]
    assert final["comm/sent_bytes/outer_delta"] == 800 and final["time/elapsed_s"] == 1.5
    assert not any(k.startswith("comm/bytes_per_step/") or k == "train/tokens_per_s" for k in final)
