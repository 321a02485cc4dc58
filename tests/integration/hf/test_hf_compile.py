"""`islands train --task hf-causal-lm --compile` (issue #34; docs/own-model.md, "Compiled models"): a tiny GPT-2 built
from a config, trained by one worker in this process (islands.cli.cmd_train), compiled after `wrap` with aot_eager,
exits 0, records its compile time in run.json, and trains as the same job run eagerly: the training and validation
losses within fp32 tolerance, the exported transformers model under the same names with the same values."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from harness.flags import flags, tiny
from harness.hf import JSON_PKG
from islands.cli import main

pytestmark = pytest.mark.slow  # transformers' import, a BPE tokenizer trained and dynamo tracing GPT-2: ~15 s


def _train(run_dir, *argv: str) -> int:
    try:
        main(
            [
                "train",
                "--task",
                "hf-causal-lm",
                "--task.model",
                "gpt2",
                "--task.vocab_size",
                "320",
                "--data",
                str(JSON_PKG),
                *tiny(global_batch=2, workers=1, steps=4, eval_every=0, eval_batches=1, warmup=0, log_every=1),
                *flags(no_probe=True, no_progress=True, run_dir=run_dir),
                *argv,
            ]
        )
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_cli_compile_trains_a_transformers_task_as_the_eager_run(tmp_path, capsys):
    from safetensors.torch import load_file

    assert _train(tmp_path / "eager") == 0
    assert _train(tmp_path / "compiled", "--compile", "--compile-backend", "aot_eager") == 0, capsys.readouterr().err
    eager, compiled = (json.loads((tmp_path / r / "run.json").read_text()) for r in ("eager", "compiled"))
    assert "compile" not in eager
    part = compiled["compile"]
    assert compiled["config"]["train"]["compile"] is True and part["backend"] == "aot_eager"
    assert part["graphs"] >= 1 and part["seconds"] == compiled["summary"]["compile_seconds"] > 0
    losses = [[e["loss"] for e in r["series"]["train"]] for r in (eager, compiled)]
    assert len(losses[1]) == 4
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        compiled["summary"]["final_val_loss"], eager["summary"]["final_val_loss"], rtol=1e-5, atol=1e-6
    )
    want, got = (load_file(str(tmp_path / r / "model" / "model.safetensors")) for r in ("eager", "compiled"))
    assert sorted(got) == sorted(want)  # transformers' names, no _orig_mod. prefix
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
