"""topkq's compiled one pass (session 40: quantisation and the residual's update in cache, Elias-Fano coding, the
decayed residual's FMA) on models islands did not write, through the public API: a `transformers` GPT-2 built from
a config (its forward returns a ModelOutput) and a model compiled with torch.compile, trained by islands.Trainer as
two simulated islands under DiLoCo whose exchange sends the 146x spec. The compiled loops (base.USE_KERNELS) and
torch's ops end on the same global model, bit for bit, every island on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import islands
import islands.compress.base as base
from harness.user_models import lm_loss, rows, small_net, tiny_gpt2, tokens
from islands.compress import parse_compressor
from islands.compress.topkq import TopKQ
from islands.outer import DiLoCo
from islands.runtime.compiled import Compile
from islands.sync.outer.exchange import Exchange

SPEC = "topkq:ratio=0.0215,bits=2,index=elias-fano,decay=0.95,chunk=256"  # small models: chunks of 256
STEPS = 6


def wide_net() -> nn.Module:
    return small_net(64)


def _fit(make_model, loss_fn, data, compile=None) -> list[torch.Tensor]:
    def main(world):
        model = make_model()
        strategy = DiLoCo(inner_steps=2, exchange=Exchange(compressor=parse_compressor(SPEC)))
        trainer = islands.Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn,
            data,
            batch_size=4,
            strategy=islands.Stack(outer=strategy),
            world=world,
            log_every=10**9,
            compile=compile,
        )
        trainer.fit(STEPS)
        return torch.cat([p.detach().reshape(-1) for p in trainer.eval_model.parameters()])

    torch.set_num_threads(1)
    return islands.simulate.run(main, islands=2)


@pytest.mark.slow  # transformers' import and dynamo's tracing: make test, not make test-fast
@pytest.mark.parametrize("case", ["gpt2", "compiled"])
def test_the_146x_spec_trains_a_users_model_the_same_with_and_without_the_compiled_loops(case, monkeypatch):
    if case == "gpt2":
        pytest.importorskip("transformers")
        args = (tiny_gpt2, lm_loss, tokens())
        kw = {}
    else:
        args = (wide_net, F.cross_entropy, rows())
        kw = {"compile": Compile(backend="aot_eager")}
    one_pass = []
    inner = TopKQ.compress_residual
    monkeypatch.setattr(TopKQ, "compress_residual", lambda self, *a, **k: one_pass.append(1) or inner(self, *a, **k))
    monkeypatch.setattr(base, "USE_KERNELS", True)
    compiled_loops = _fit(*args, **kw)
    assert len(one_pass) == 2 * STEPS // 2  # each island's every round went through the one pass
    monkeypatch.setattr(base, "USE_KERNELS", False)
    torch_ops = _fit(*args, **kw)
    assert len(one_pass) == 2 * STEPS // 2  # and none without the compiled loops
    assert all(torch.equal(compiled_loops[0], m) for m in compiled_loops[1:])  # one global model
    assert torch.equal(compiled_loops[0].view(torch.int32), torch_ops[0].view(torch.int32))
    start = torch.cat([p.detach().reshape(-1) for p in args[0]().parameters()])
    assert not torch.equal(compiled_loops[0], start)  # it trained
