"""`islands export RUN_DIR OUT`: the global model of a run (under DiLoCo: the outer model, not an island's) and its
tokenizer in the Hugging Face format; transformers loads it, its logits equal the islands model's, it generates.
Bad input is exit code 2 and nothing half-written."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from harness.hf import JSON_PKG, run_hf_job
from islands.app import export as ex
from islands.cli import main
from islands.config import JobConfig, dump_json
from islands.tasks import hf_causal_lm, hf_lm

pytestmark = pytest.mark.slow  # jobs of 2 and 4 gloo ranks forked from this process (tests/harness/hf.py)
ATOL = 1e-5


def _cli(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


@pytest.fixture(scope="module")
def diloco_run(tmp_path_factory):
    """GPT-2 on two islands of one worker, DiLoCo every 4 steps, checkpoints at steps 3 (mid-round) and 6."""
    run_dir = tmp_path_factory.mktemp("export") / "run"
    # the worker's own code on 2 ranks, as `islands train --task hf-causal-lm --task.model gpt2 --workers 2 --islands 2
    # --outer diloco:inner_steps=4 --steps 6 --ckpt-every 3` runs it (hf_ranks.TINY: the rest of the tiny shape)
    run_hf_job(
        run_dir,
        timeout=300,
        **{
            "task.model": "gpt2",
            "workers": 2,
            "islands": 2,
            "outer": "diloco:inner_steps=4",
            "steps": 6,
            "ckpt_every": 3,
        },
    )
    return run_dir


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """What a new user runs (issue #35 item 6): their own model directory (a GPT-2 config copied with GPT-2's token
    ids, far outside its 320-token vocabulary) on a Parquet corpus, 2 islands x 2 workers, DiLoCo, no checkpoints."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import GPT2Config

    root = tmp_path_factory.mktemp("plain")
    GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=320).save_pretrained(str(root / "mine"))
    docs = [d for p in sorted(JSON_PKG.glob("*.py")) for d in p.read_text().split("\n\n") if d.strip()]
    pq.write_table(pa.table({"text": docs}), root / "corpus.parquet")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ISLANDS_CACHE", str(root / "cache"))  # the tokenised corpus, not the user's ~/.cache
        record = run_hf_job(
            root / "run",
            timeout=300,
            **{
                "task.model": str(root / "mine"),
                "data": str(root / "corpus.parquet"),
                "workers": 4,
                "islands": 2,
                "outer": "diloco:inner_steps=3",
                "steps": 6,
            },
        )
    return root / "run", record


def _logits(model, x):
    with torch.no_grad():
        return model(x).logits


def test_export_round_trip_is_the_outer_model(diloco_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    assert _cli(["export", str(diloco_run), str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    ours, tok, step = ex.global_model(diloco_run)
    assert step == 6 and type(model).__name__ == "GPT2LMHeadModel"
    text = "import json\nprint(json.dumps({'a': 1}))\n"
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == tok.encode(text, add_special_tokens=False).ids  # the run's own tokenizer
    assert tokenizer.decode(ids[0]) == text
    ids = ids[:, :16]  # within the model's 32 positions, generated tokens included
    assert torch.allclose(_logits(model, ids), _logits(ours, ids), atol=ATOL, rtol=0)
    generated = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 5)
    assert isinstance(tokenizer.decode(generated[0]), str)

    # Step 3 falls inside DiLoCo's first round (4 inner steps): the global model there is still the initial one,
    # while each island has trained 3 steps. Export writes the global (outer) model.
    mid = tmp_path / "mid"
    assert _cli(["export", str(diloco_run), str(mid), "--step", "3"]) == 0
    at3 = AutoModelForCausalLM.from_pretrained(str(mid), dtype=torch.float32).eval()
    config = json.loads((diloco_run / hf_lm.HF_CONFIG_FILE).read_text())
    from transformers import AutoConfig

    initial = hf_lm.build_model(AutoConfig.for_model(config.pop("model_type"), **config), seed=0).eval()
    assert torch.allclose(_logits(at3, ids), _logits(initial, ids), atol=ATOL, rtol=0)
    assert not torch.allclose(_logits(at3, ids), _logits(model, ids), atol=1e-3)


def test_an_exported_directory_trains_on(diloco_run, tmp_path):
    """`--task.model OUT`: from_pretrained of the export, with its own tokenizer (tokenizer=auto)."""
    out = tmp_path / "hf"
    assert ex.export(diloco_run, out, verify=False)["step"] == 6
    task = hf_causal_lm(model=str(out), data=str(JSON_PKG), context=32, batch_size=2, eval_batches=1)
    ours, tok, _ = ex.global_model(diloco_run)
    assert all(torch.equal(a, b) for a, b in zip(task.model.state_dict().values(), ours.state_dict().values()))
    assert task.tokenizer.to_str() == tok.to_str() and "loaded" in task.data_source


def test_bad_exports_are_exit_2_and_nothing_half_written(diloco_run, tmp_path, capsys, monkeypatch):
    lm_run = tmp_path / "lm-run"
    lm_run.mkdir()
    dump_json(JobConfig(), lm_run / "config.json")  # the built-in byte-level lm task
    taken = tmp_path / "taken"
    taken.mkdir()
    cases = [
        ([str(lm_run), str(tmp_path / "a")], "trained task 'lm'"),
        ([str(tmp_path / "nowhere"), str(tmp_path / "b")], "is not a run directory"),
        ([str(diloco_run), str(taken)], "exists; export writes a new directory"),
        ([str(diloco_run), str(tmp_path / "c"), "--step", "5"], "no checkpoint for step 5"),
    ]
    for argv, message in cases:
        assert _cli(["export", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm-run", "taken"]

    def broken(*args, **kwargs):
        raise ex.ExportError("simulated failure after the files were written")

    monkeypatch.setattr(ex, "_check_loads", broken)
    assert _cli(["export", str(diloco_run), str(tmp_path / "d")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm-run", "taken"]  # no OUT, no temporary sibling


def test_a_run_keeps_its_global_model_beside_its_checkpoints(diloco_run, tmp_path, capsys):
    """RUN/model is what the final checkpoint holds (both are strategy.eval_model after the final sync: the outer
    model); with checkpoints there, export still reads the newest of them, as before."""
    from safetensors.torch import load_file

    from islands.checkpoint.store.directory import CheckpointStore

    kept = diloco_run / "model"
    assert json.loads((kept / "islands.json").read_text())["step"] == 6
    final = CheckpointStore(diloco_run / "ckpt", clean=False).load(6, rank=0).tree["model"]
    weights = load_file(str(kept / "model.safetensors"))
    assert set(weights) <= set(final) and all(torch.equal(weights[k], final[k]) for k in weights)
    assert json.loads((diloco_run / "run.json").read_text())["model"]["dir"] == str(kept)
    assert _cli(["export", str(diloco_run), str(tmp_path / "hf")]) == 0
    assert f"from step 6 of {diloco_run} (its checkpoint)" in capsys.readouterr().out


def test_a_run_without_checkpoints_exports_the_model_it_ended_with(plain_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, record = plain_run
    assert not (run_dir / "ckpt").exists() and record["world"]["workers_per_island"] == 2
    assert record["model"] == {**record["model"], "dir": str(run_dir / "model"), "step": 6, "format": "transformers"}
    # exactly one model, whole: no second directory, no temporary of one (4 workers, only rank 0 writes)
    assert sorted(p.name for p in run_dir.iterdir() if "model" in p.name) == ["model"]
    out = tmp_path / "hf"
    assert _cli(["export", str(run_dir), str(out)]) == 0
    assert f"from step 6 of {run_dir} (the model it ended with)" in capsys.readouterr().out
    kept = AutoModelForCausalLM.from_pretrained(str(run_dir / "model"), dtype=torch.float32).eval()
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    ids = tokenizer("import json\nprint(json.dumps([1, 2]))\n", return_tensors="pt")["input_ids"][:, :16]
    assert torch.equal(_logits(kept, ids), _logits(exported, ids))
    # the user's GPT-2 ids (50256) do not fit a 320-token vocabulary: generation ends at the run's own end-of-text
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert exported.config.eos_token_id == exported.generation_config.eos_token_id == eos < 320
    assert exported.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, ids.shape[1] + 3)

    # --step names a checkpoint, which this run has none of; a run that never finished has no model either
    assert _cli(["export", str(run_dir), str(tmp_path / "a"), "--step", "3"]) == 2
    assert "has no checkpoint directory" in capsys.readouterr().err
    (run_dir / "model").rename(run_dir / "kept")
    try:
        assert _cli(["export", str(run_dir), str(tmp_path / "b")]) == 2
        assert "has neither the model it ends with" in capsys.readouterr().err
    finally:
        (run_dir / "kept").rename(run_dir / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
