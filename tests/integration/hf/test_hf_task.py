"""`transformers` causal LMs as a task (`--task hf-causal-lm`, `islands.tasks.hf_causal_lm`): tiny GPT-2, Llama and
Qwen2 configs built from config classes (random initialisation, nothing downloaded) train on gloo ranks through
ddp, fsdp (units: the model's own decoder layers) and DiLoCo; bad input is a message and exit code 2, with
nothing written."""

from __future__ import annotations

import math
import re

import pytest
import torch

pytest.importorskip("transformers")

import islands
from harness.hf import JSON_PKG, TINY, run_hf_job
from islands.app.validate import validate
from islands.cli import main
from islands.config import ConfigError, from_mapping
from islands.sync.wrap_policy import BlockWrap
from islands.tasks import hf_lm
from islands.tasks.user import TaskError

SHAPE = dict(d_model=32, n_layers=2, n_heads=2, context=32, vocab=320, eos=0)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_family_configs_are_small_and_take_overrides(family):
    config = hf_lm.family_config(family, **SHAPE, overrides={})
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.vocab_size) == (
        32,
        2,
        2,
        320,
    )
    assert hf_lm.max_positions(config) == 32 and config.eos_token_id == 0
    model = hf_lm.build_model(config, seed=0)
    assert sum(p.numel() for p in model.parameters()) < 100_000
    again = hf_lm.build_model(config, seed=0)  # every rank starts from the same weights
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    # the wrap policy `block` makes each of the model's own decoder layers an FSDP unit
    units = BlockWrap().groups(model)
    assert len(units) == 2 and {type(g[0]).__name__ for g in units} == set(model._no_split_modules)
    key = "n_layer" if family == "gpt2" else "num_hidden_layers"
    assert hf_lm.family_config(family, **SHAPE, overrides={key: 3}).num_hidden_layers == 3


def test_overrides_parse_and_typos_are_named():
    assert hf_lm.parse_overrides("n_layer=2,n_embd=64,activation_function=gelu_new,tie_word_embeddings=false") == {
        "n_layer": 2,
        "n_embd": 64,
        "activation_function": "gelu_new",
        "tie_word_embeddings": False,
    }
    with pytest.raises(TaskError, match="has no key 'n_layers' \\(did you mean n_layer"):
        hf_lm.family_config("gpt2", **SHAPE, overrides={"n_layers": 2})
    with pytest.raises(TaskError, match="every entry needs a key"):
        hf_lm.parse_overrides("n_layer")
    with pytest.raises(TaskError, match="neither a causal-LM family"):
        hf_lm.family_config("gpt3", **SHAPE, overrides={})


def test_public_api_task_trains_with_the_trainer():
    task = islands.tasks.hf_causal_lm(
        model="qwen2",
        tokenizer="byte",
        data=str(JSON_PKG),
        context=32,
        batch_size=2,
        eval_batches=2,
        d_model=32,
        n_layers=1,
        n_heads=2,
    )
    assert isinstance(task, islands.Task) and task.hf_config.vocab_size == 257 and task.classes == 257
    opt = torch.optim.AdamW(task.model.parameters(), lr=3e-3)
    trainer = islands.Trainer(
        model=task.model,
        optimizer=opt,
        loss_fn=task.loss_fn,
        train_data=task.train_data,
        val_data=task.val_data,
        batch_size=task.batch_size,
        world=islands.World.single(),
        callbacks=[islands.Evaluate(every=0)],
    )
    trainer.fit(3)
    assert math.isfinite(trainer.series["val"][-1]["val_loss"])


@pytest.mark.slow  # four jobs of 2-4 gloo ranks forked from this process: 1-10 s each on a shared 2-core machine
@pytest.mark.parametrize(
    "family,strategy", [("gpt2", "ddp"), ("gpt2", "fsdp"), ("llama", "fsdp"), ("llama", "ddp+diloco")]
)
def test_tiny_models_train_on_gloo_ranks(tmp_path, family, strategy):
    """GPT-2 and Llama through ddp, fsdp and DiLoCo (GPT-2 DiLoCo, exported after, is in
    tests/integration/hf/test_export.py)."""
    # ddp+diloco: two islands of two workers, DDP inside each, DiLoCo across them
    extra = (
        {"outer": "diloco:inner_steps=2", "islands": 2, "workers": 4} if "diloco" in strategy else {"inner": strategy}
    )
    record = run_hf_job(tmp_path / "run", **{"workers": 2, "task.model": family, **extra})
    s = record["summary"]
    assert s["strategy"] == strategy and s["workers"] == (4 if "diloco" in strategy else 2)
    assert s["final_val_loss"] < math.log(320)  # below a uniform guess after 4 steps: it learns
    assert (tmp_path / "run" / "tokenizer.json").is_file() and (tmp_path / "run" / "hf_config.json").is_file()


def _exit_code(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_bad_input_is_exit_2_and_nothing_written(tmp_path, capsys):
    flags = ["train", "--task", "hf-causal-lm", "--workers", "1", "--steps", "1", "--no-probe", "--no-progress"]
    empty_dir = tmp_path / "weights"
    empty_dir.mkdir()
    (tmp_path / "empty.txt").write_text("")
    big = tmp_path / "big.json"
    from islands.data import tokenizer as tk

    tk.save(tk.train_bpe([(JSON_PKG / "decoder.py").read_text()], 600), big)
    cases = [
        (["--task.model", str(empty_dir)], "the directory has no config.json"),
        (["--data", str(tmp_path / "empty.txt")], "holds no text to train on"),
        (
            ["--task.tokenizer", str(big), "--task.model_overrides", "vocab_size=512"],
            "has 600 tokens but the model's embedding has 512 rows",
        ),
        (["--task.model_overrides", "n_embd=64,n_layers=3"], "has no key 'n_layers'"),
        (
            ["--task.model", "gpt2", "--context", "64", "--task.model_overrides", "n_positions=32"],
            "task.context=64 exceeds the model's 32 positions",
        ),
        (["--inner", "pipeline", "--workers", "2"], "ties its input and output embeddings"),
    ]
    for n, (extra, message) in enumerate(cases):
        run_dir = tmp_path / f"run{n}"
        assert _exit_code([*flags, "--data", str(JSON_PKG), *extra, "--run-dir", str(run_dir)]) == 2, extra
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (extra, err)
        assert not run_dir.exists()
    with pytest.raises(ConfigError, match=re.escape("task.name must be lm, digits, hf-causal-lm")):
        validate(from_mapping({**TINY, "task": "hf-causal"}))
