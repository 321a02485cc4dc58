"""A model compiled with torch.compile under islands' framework callbacks (issue #34 item 1, docs/frameworks.md
"Compiled models"): the Hugging Face Trainer compiling the model itself (`torch_compile=True`), and a LightningModule
whose network is compiled inside it, train through the outer strategy's hooks exactly as their eager runs do: the same
losses and the same final (global) parameters. aot_eager: islands' plumbing (the callback attaching to the live
parameters the compiled graph reads, the outer step writing into them, the global model copied back at the end) is
under test, not inductor's code (tests/unit/loop/test_compile.py has an inductor run). One process, one island: the
outer strategy's copies and outer step run as in a job of several, over a Comm of one (test_frameworks.py has the
2-island jobs). Not a process test: about 10 s of CPU in all, most of it importing transformers and Lightning."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import islands

pytestmark = pytest.mark.slow
BACKEND = "aot_eager"


def _hf_run(tmp_path, compiled: bool) -> tuple[list[float], list[torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from islands.integrations.transformers import IslandsCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    tokens = torch.randint(0, 64, (48, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": ids, "labels": ids} for ids in tokens]
    args = TrainingArguments(
        str(tmp_path / ("compiled" if compiled else "eager")),
        max_steps=6,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        torch_compile=compiled,
        torch_compile_backend=BACKEND if compiled else None,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=data, callbacks=[IslandsCallback(islands.outer.DiLoCo(inner_steps=3))]
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, [p.detach().clone() for p in model.parameters()]


def test_hf_trainer_compiling_the_model_trains_under_the_callback_as_eagerly(tmp_path):
    torch._dynamo.reset()
    eager = _hf_run(tmp_path, compiled=False)
    counters.clear()
    compiled = _hf_run(tmp_path, compiled=True)
    assert counters["stats"]["unique_graphs"] >= 1  # the Trainer did run a compiled model
    assert len(compiled[0]) == 6 and compiled[0] == eager[0]
    for c, e in zip(compiled[1], eager[1]):
        torch.testing.assert_close(c, e, rtol=0, atol=0)


def _lightning_module(compiled: bool):
    """A LightningModule of the test's own (Lightning is imported inside the tests only)."""
    import lightning.pytorch as L

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
            if compiled:  # compiled inside the module (torch.compile of the LightningModule itself: see docs)
                self.net = torch.compile(self.net, backend=BACKEND)
            self.losses: list[float] = []

        def training_step(self, batch, i):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Classifier()


def _lightning_run(compiled: bool) -> tuple[list[float], list[torch.Tensor]]:
    import lightning.pytorch as L

    from islands.integrations.lightning import IslandsCallback

    torch.manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 4, (64,)))
    module = _lightning_module(compiled)
    trainer = L.Trainer(
        max_steps=6,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[IslandsCallback(islands.outer.DiLoCo(inner_steps=3))],
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    return module.losses, [p.detach().clone() for p in module.parameters()]


def test_lightning_with_a_compiled_network_trains_under_the_callback_as_eagerly():
    torch._dynamo.reset()
    eager = _lightning_run(compiled=False)
    counters.clear()
    compiled = _lightning_run(compiled=True)
    assert counters["stats"]["unique_graphs"] >= 1
    assert len(compiled[0]) == 6 and compiled[0] == eager[0]
    for c, e in zip(compiled[1], eager[1]):
        torch.testing.assert_close(c, e, rtol=0, atol=0)
