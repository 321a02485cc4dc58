"""Issue #34 item 2 for transformers models: the task builds them with SDPA attention (torch's fused kernels on a GPU)
where the architecture has it, falls back to transformers' own choice where it does not, and says which in the
run record's data line."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from islands.tasks import hf_causal_lm, hf_lm

SHAPE = dict(d_model=32, n_layers=1, n_heads=2, context=16, vocab=64, eos=0)


def test_gpt2_built_by_the_task_uses_sdpa(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("def main():\n    return 0\n" * 200)
    task = hf_causal_lm(
        model="gpt2", tokenizer="byte", data=str(text), context=16, batch_size=2, eval_batches=1, d_model=32, n_layers=1
    )
    assert task.model.config._attn_implementation == "sdpa"
    assert task.data_source.endswith("; attention: sdpa")


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_the_tested_families_use_sdpa(family):
    model = hf_lm.build_model(hf_lm.family_config(family, **SHAPE, overrides={}), seed=0)
    assert hf_lm.attention_of(model) == "sdpa"


def test_an_architecture_without_sdpa_gets_transformers_choice_from_the_same_seed():
    from transformers import AutoConfig, AutoModelForCausalLM

    try:  # granite_swa has no SDPA path in transformers 5.x; another version may lack the model or gain the path
        config = AutoConfig.for_model(
            "granite_swa", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            intermediate_size=64, vocab_size=64,
        )  # fmt: skip
    except (KeyError, ValueError):
        pytest.skip("this transformers has no granite_swa model")
    model = hf_lm.build_model(config, seed=3)
    if hf_lm.attention_of(model) == "sdpa":
        pytest.skip("granite_swa has an SDPA path in this transformers")
    assert hf_lm.attention_of(model) == "eager"
    torch.manual_seed(3)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
