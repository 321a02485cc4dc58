"""transformers causal LMs cut into pipeline pieces (islands.parallel.pipeline.hf_pieces): the pieces give the model's
logits; a two-stage pipeline over gloo gives the unsplit model's loss and gradients; the CLI trains GPT-2 and Llama
with `--inner pipeline` and refuses what cannot be cut, before any worker starts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness.hf import JSON_PKG, run_hf_job  # noqa: E402
from harness.outer import run_world  # noqa: E402
from islands.cli import main  # noqa: E402
from islands.parallel.pipeline import pieces_of  # noqa: E402

V = 64


def _model(family: str, attn: str = "sdpa", tie: bool = False):
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=V,
            n_positions=32,
            n_embd=16,
            n_layer=2,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
            tie_word_embeddings=tie,
            attn_implementation=attn,
        )
        return transformers.GPT2LMHeadModel(cfg)
    kw = dict(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
        attn_implementation=attn,
    )
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))


def _ids(seed=1, b=4, t=12):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (b, t), generator=g)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_the_pieces_give_the_models_logits(family):
    model = _model(family).eval()
    ids = _ids()
    x = ids
    pieces = pieces_of(model)
    assert len(pieces) == 2 + 2  # embedding, two decoder layers, norm + head
    for p in pieces:
        x = p(x)
    assert torch.equal(x, model(input_ids=ids).logits)
    owned = {id(p) for piece in pieces for p in piece.parameters()}
    assert owned == {id(p) for p in model.parameters()}  # every parameter in exactly the pieces, none copied


def test_eager_attention_and_unknown_layouts_are_refused():
    with pytest.raises(TypeError, match="sdpa"):
        pieces_of(_model("llama", attn="eager"))  # eager attention is not causal without a mask: wrong logits

    class Other(torch.nn.Module):
        config = object()
        lm_head = torch.nn.Linear(2, 2)

    with pytest.raises(TypeError, match="cannot split Other"):
        pieces_of(Other())


def _two_stages(world):
    from islands.models import sequence_loss
    from islands.parallel.pipeline import PipelineRunner, build_stages

    out = {}
    for family in ("gpt2", "llama"):
        model = _model(family).double().eval()  # dropout off: both sides draw no random masks
        pieces = pieces_of(model)
        stage = build_stages(pieces, [0, 2])[world.rank]
        runner = PipelineRunner(pieces, stage, world.comm("global"), "1f1b", sequence_loss)
        ids = _ids(2, t=9)
        loss = runner.step(ids[:, :-1], ids[:, 1:], 2)
        names = {id(p): n for n, p in model.named_parameters()}
        out[family] = {
            "loss": None if loss is None else float(loss),
            "grads": {names[id(p)]: p.grad.numpy().copy() for p in stage.parameters()},
        }
    return out


def test_a_two_stage_pipeline_equals_the_unsplit_model():
    from islands.models import sequence_loss

    ranks = run_world(_two_stages, size=2, islands=1, timeout=120)
    for family in ("gpt2", "llama"):
        model = _model(family).double().eval()
        ids = _ids(2, t=9)
        loss = sequence_loss(model(input_ids=ids[:, :-1]).logits, ids[:, 1:])
        loss.backward()
        assert ranks[1][family]["loss"] == pytest.approx(loss.item(), rel=1e-12)  # the last stage has the loss
        grads = {**ranks[0][family]["grads"], **ranks[1][family]["grads"]}
        assert set(grads) == {n for n, _ in model.named_parameters()}
        for n, p in model.named_parameters():
            np.testing.assert_allclose(grads[n], p.grad.numpy(), rtol=1e-9, atol=1e-12, err_msg=f"{family} {n}")


@pytest.mark.slow  # two jobs of 2 gloo ranks forked from this process
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_cli_trains_a_transformers_model_as_a_pipeline(tmp_path, family):
    record = run_hf_job(
        tmp_path / "run",
        workers=2,
        inner="pipeline",
        microbatches="2",
        **{"task.model": family, "task.model_overrides": "tie_word_embeddings=false"},
    )
    s = record["summary"]
    assert s["strategy"] == "pipeline" and s["workers"] == 2
    assert s["final_val_loss"] < math.log(320)  # below a uniform guess after 4 steps: it learns


def _exit_2(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    return err


def test_what_cannot_be_cut_exits_2_before_any_worker(tmp_path, capsys):
    flags = [
        "train",
        "--task",
        "hf-causal-lm",
        "--steps",
        "1",
        "--no-probe",
        "--no-progress",
        "--data",
        str(JSON_PKG),
        "--inner",
        "pipeline",
        "--d-model",
        "32",
        "--n-heads",
        "2",
        "--context",
        "32",
    ]
    err = _exit_2([*flags, "--workers", "2", "--run-dir", str(tmp_path / "a")], capsys)
    assert "ties its input and output embeddings" in err and "tie_word_embeddings=false" in err
    err = _exit_2(
        [
            *flags,
            "--workers",
            "5",
            "--global-batch",
            "10",
            "--n-layers",
            "2",
            "--task.model",
            "llama",
            "--run-dir",
            str(tmp_path / "b"),
        ],
        capsys,
    )
    assert "inner.stages=5" in err and "only 4 pieces" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
