"""Issue #18 item 5 for transformers models: the model's own gradient checkpointing behind `activation_checkpointing`
(non-reentrant, KV cache off, gradients unchanged) and the "auto" precision (bf16 autocast on CUDA, fp32 on CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from islands.app.build import build_step_fn
from islands.config import from_mapping
from islands.loop.task import Task
from islands.memory import ForwardBackward, enable_activation_checkpointing, resolve_precision
from islands.models import ByteTransformer, sequence_loss
from islands.runtime.world import World
from islands.tasks import hf_lm

SHAPE = dict(d_model=32, n_layers=2, n_heads=2, context=16, vocab=64, eos=0)


def _model(family: str):
    return hf_lm.build_model(hf_lm.family_config(family, **SHAPE, overrides={}), seed=0)


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (2, 17), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _grads(model, seed: int = 5) -> tuple[dict, int]:
    """The gradients of one batch's loss, and how many tensors autograd saved for backward."""
    x, y = _batch()
    model.train()
    torch.manual_seed(seed)  # GPT-2's dropout draws: the recomputation must replay the same masks
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
        loss = sequence_loss(model(x).logits, y)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, len(saved)


def _on(model) -> bool:
    return (
        model.is_activation_checkpointing
        if hasattr(model, "is_activation_checkpointing")
        else model.is_gradient_checkpointing
    )


def _layers(model):
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_own_gradient_checkpointing_leaves_gradients_unchanged(family):
    plain, ckpt = _model(family), _model(family)
    assert enable_activation_checkpointing(ckpt) == "transformers"
    assert _on(ckpt) and ckpt.config.use_cache is False
    mlp = _layers(ckpt)[0].mlp
    calls, forward = [], mlp.forward
    mlp.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)  # (module hooks do not run in a recompute)
    (want, held), (got, held_ckpt) = _grads(plain), _grads(ckpt)
    assert len(calls) == 2, "the first decoder layer's MLP ran once: nothing was recomputed in backward"
    assert held_ckpt < held / 2, (held_ckpt, held)  # what checkpointing is for: far fewer tensors held
    assert want.keys() == got.keys() and len(want) == len(list(plain.parameters()))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_checkpointing_is_non_reentrant_and_exact_with_a_frozen_embedding():
    """The layers' checkpoint function is torch's non-reentrant form (it needs no input requiring grad, takes keyword
    arguments and works inside DDP's no_sync); with the embedding frozen the layers still get their full gradients."""
    plain, ckpt = _model("llama"), _model("llama")
    for m in (plain, ckpt):
        m.get_input_embeddings().requires_grad_(False)
    enable_activation_checkpointing(ckpt)
    assert all(layer._gradient_checkpointing_func.keywords == {"use_reentrant": False} for layer in _layers(ckpt))
    (want, _), (got, _) = _grads(plain), _grads(ckpt)
    assert any("layers.0" in n for n in got) and want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_the_job_config_switches_it_on_and_refuses_what_cannot():
    cfg = from_mapping({"activation_checkpointing": True})
    model = _model("gpt2")
    model.config.use_cache = True
    build_step_fn(cfg, Task(model=model, loss_fn=sequence_loss, train_data=[_batch()]), None, World.single())
    assert _on(model) and model.config.use_cache is False
    own = ByteTransformer(d_model=16, n_layers=3, n_heads=2, context=8)
    assert enable_activation_checkpointing(own) == "islands" and own.checkpoint_segments == 3
    with pytest.raises(ValueError, match="neither islands' set_activation_checkpointing nor transformers'"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))


class _Probe(torch.nn.Module):
    """Records the autocast state its forward ran under."""

    def __init__(self, device):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, device=device)
        self.seen = None

    def forward(self, x):
        dev = x.device.type
        self.seen = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        return self.lin(x)


def _step(precision: str, device: str):
    torch.manual_seed(0)
    model = _Probe(device)
    x = torch.randn(4, 8, device=device)
    y = torch.randn(4, 8, device=device)
    step = ForwardBackward(precision=precision)
    loss = step(model, (x, y), torch.nn.functional.mse_loss)
    return model, step, loss


def test_auto_precision_is_plain_fp32_on_cpu():
    assert hf_lm.PRECISION == "auto" and resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("bf16", "cpu") == "bf16"  # an explicit choice stays
    auto, step, loss = _step("auto", "cpu")
    fp32, _, want = _step("fp32", "cpu")
    assert auto.seen[0] is False and torch.equal(loss, want)
    assert torch.equal(auto.lin.weight.grad, fp32.lin.weight.grad)
    assert step.record()["precision_resolved"] == "fp32"
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, auto"):
        resolve_precision("fp16", "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_precision_is_bf16_autocast_on_cuda():
    if not torch.cuda.is_bf16_supported():
        assert resolve_precision("auto", "cuda") == "fp32"
        return
    assert resolve_precision("auto", "cuda") == "bf16"
    model, step, _ = _step("auto", "cuda")
    assert model.seen == (True, torch.bfloat16)
    assert model.lin.weight.dtype == torch.float32 and model.lin.weight.grad.dtype == torch.float32
    assert step.record()["precision_resolved"] == "bf16"


def test_the_job_leaves_precision_to_the_task_unless_it_is_given():
    """memory.precision = "task" (the default): the hf task's auto, the built-in tasks' fp32, fp32 under fsdp and
    pipeline (which take no precision); an explicit value wins."""
    from harness.hf import TINY
    from islands.app.build import build_task, step_precision
    from islands.app.validate import validate
    from islands.config import from_mapping

    hf_cfg = validate(from_mapping(dict(TINY)))
    hf_task = build_task(hf_cfg)
    assert hf_cfg.memory.precision == "task" and step_precision(hf_cfg, hf_task) == "auto"
    explicit = validate(from_mapping({**TINY, "precision": "fp32"}))
    assert step_precision(explicit, hf_task) == "fp32"
    sharded = validate(from_mapping({**TINY, "inner": "fsdp", "workers": 2}))
    assert step_precision(sharded, hf_task) == "fp32"
    lm_cfg = validate(from_mapping({"task": "lm", "d_model": 16, "n_layers": 1, "n_heads": 2, "context": 8}))
    assert step_precision(lm_cfg, build_task(lm_cfg)) == "fp32"
