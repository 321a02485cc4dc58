"""Every run keeps its model and says where (issue #35 item 6): `islands train` on 2 gloo ranks (2 islands, DiLoCo),
no checkpoints, `--no-progress` as in CI or under nohup. Rank 0's output keeps the summary and the paths of
run.json, the model and the logs; RUN/model holds the model the final evaluation scored, once."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_model

from harness.cli import islands_cli
from islands.app.build import build_task
from islands.config import from_mapping
from islands.data.source import val_batches
from islands.loop.evaluate import evaluate


def test_a_run_without_checkpoints_keeps_its_global_model_and_no_progress_still_says_where(tmp_path, capfd):
    run = tmp_path / "run"
    flags = ["--task", "digits", "--workers", "2", "--islands", "2", "--outer", "diloco:inner_steps=3"]
    flags += ["--steps", "6", "--global-batch", "16", "--eval-every", "0", "--warmup", "1", "--threads", "1"]
    assert islands_cli("train", *flags, "--no-probe", "--no-progress", "--run-dir", str(run)) == 0
    out = capfd.readouterr().out  # rank 0's stdout is the launcher's
    assert "islands run summary" in out and "final val accuracy" in out
    for line in (
        f"run record: {run / 'run.json'}  plot: {run / 'loss.png'}",
        f"model: {run / 'model'} (step 6, safetensors)",
        f"logs: {run / 'logs'}",
    ):
        assert line in out, out

    record = json.loads((run / "run.json").read_text())
    assert record["model"]["dir"] == str(run / "model") and record["model"]["strategy"] == "ddp+diloco"
    assert sorted(p.name for p in run.iterdir() if "model" in p.name) == ["model"]  # one, whole (rank 0 wrote it)
    assert sorted(p.name for p in (run / "model").iterdir()) == ["islands.json", "model.safetensors"]
    # the kept model is the one the final evaluation scored: the global model after the final synchronisation
    task = build_task(from_mapping(record["config"]))
    missing, unexpected = load_model(task.model, str(run / "model" / "model.safetensors"))
    assert not missing and not unexpected
    torch.set_num_threads(1)  # as the worker evaluated
    again = evaluate(task.model, val_batches(task.val_data, task.batch_size), task.loss_fn, torch.device("cpu"))
    assert again["val_loss"] == record["summary"]["final_val_loss"]
    assert again["val_accuracy"] == record["summary"]["final_val_accuracy"]
