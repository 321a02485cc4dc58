"""A transformers model's kept model (RUN_DIR/model, issue #35 item 6) and `islands export` share one save:
save_pretrained's files with the run's tokenizer, loadable with from_pretrained as they are, the config ready for
generation, and the model that is still training left as it was."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from islands.checkpoint.store import model_dir as md
from islands.data import tokenizer as tk
from islands.tasks import hf_lm

USER_EOS = 50256  # GPT-2's own end-of-text id: what a config copied from GPT-2 names, far outside a small vocabulary


def _model():
    tok = tk.byte_tokenizer()
    shape = dict(d_model=32, n_layers=1, n_heads=2, context=16, vocab=tk.vocab_size(tok), eos=tk.eos_id(tok))
    model = hf_lm.build_model(hf_lm.family_config("gpt2", **shape, overrides={}), seed=0)
    model.config.bos_token_id = model.config.eos_token_id = USER_EOS
    model.config.pad_token_id = None
    model.generation_config.eos_token_id = USER_EOS
    return model, tok


def test_the_saved_directory_loads_as_it_is_and_the_training_model_is_untouched(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = _model()
    files = md.write_model_dir(tmp_path / "model", hf_lm.PretrainedWriter(tok), model, {"step": 3})
    assert {"config.json", "model.safetensors", "tokenizer.json", md.INFO_FILE} <= set(files)
    assert md.read_info(tmp_path / "model")["format"] == "transformers"
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    text = "def f(x):\n    return x\n"
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == tok.encode(text, add_special_tokens=False).ids
    ids = ids[:, :16]  # the model's positions
    model.eval()
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
    eos = tk.eos_id(tok)
    saved = json.loads((tmp_path / "model" / "config.json").read_text())
    assert (saved["bos_token_id"], saved["eos_token_id"], saved["pad_token_id"], saved["use_cache"]) == (
        eos,
        eos,
        eos,
        True,
    )
    assert back.generation_config.eos_token_id == eos  # generation stops at the tokenizer's end-of-text
    # the model that trained on is as it was: no KV cache during training, its own ids
    assert model.config.use_cache is False
    assert (model.config.bos_token_id, model.config.pad_token_id) == (USER_EOS, None)
    assert model.generation_config.eos_token_id == USER_EOS


def test_ids_inside_the_vocabulary_are_kept(tmp_path):
    model, tok = _model()
    model.config.bos_token_id = 7
    hf_lm.save_pretrained(model, tok, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["bos_token_id"] == 7 and saved["eos_token_id"] == tk.eos_id(tok)


def test_a_transformers_model_inside_a_users_wrapper_is_saved_as_safetensors():
    """A user task whose module wraps the transformers model has no save_pretrained: its run still keeps its
    model (model.safetensors), where the transformers writer failed at the run's very end."""
    from islands.app.build import model_writer

    model, tok = _model()

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    plain = hf_lm.HFTask(model=model, loss_fn=None, train_data=[], tokenizer=tok)
    wrapped = hf_lm.HFTask(model=Wrapper(model), loss_fn=None, train_data=[], tokenizer=tok)
    assert isinstance(model_writer(plain), hf_lm.PretrainedWriter)
    assert isinstance(model_writer(wrapped), md.SafetensorsWriter)
