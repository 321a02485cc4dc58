"""Held windows (`ps:quorum=M,wait=SECONDS`) with models islands did not write, through islands.Trainer: a
`transformers` GPT-2 built from a config (its forward returns a ModelOutput) and a model compiled by torch.compile.
Two (and, for the GPT-2, three) equal simulated islands (one virtual clock) end on synchronous DiLoCo's global
model to fp32 rounding, as the digits MLP does in test_ps_wait.py; the compiled one also equals its eager run. With
compressed pulls (ps_pulls) both end on the server's exact model, near the run whose answers were whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import islands
from harness.user_models import lm_loss, rows, small_net, tiny_gpt2, tokens
from islands.compress import COMPRESSORS
from islands.outer import DiLoCo, InProcessServer, ParameterServer, VirtualClock
from islands.runtime.compiled import Compile

STEPS = 6


def _fit(make_model, loss_fn, data, strategy: str, compile=None, islands_: int = 2, pulls=None) -> list[torch.Tensor]:
    """`islands_` simulated islands, plain SGD inside (lr 0.1), the global model's parameters at the end (flat).
    `pulls`: a compressor spec for the server's answers (ps_pulls)."""
    server = InProcessServer()

    def outer():
        if strategy == "diloco":
            return DiLoCo(inner_steps=2)
        clock = VirtualClock([1.0] * islands_)
        pulled = None if pulls is None else COMPRESSORS.build(pulls)
        return ParameterServer(inner_steps=2, quorum=islands_, wait=0.5, arrivals=clock, host=server, pulls=pulled)

    def main(world):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = islands.Trainer(
            model,
            opt,
            loss_fn,
            data,
            batch_size=4,
            strategy=islands.Stack(outer=outer()),
            world=world,
            log_every=10**9,
            compile=compile,
        )
        trainer.fit(STEPS)
        return torch.cat([p.detach().reshape(-1) for p in trainer.eval_model.parameters()])

    torch.set_num_threads(1)
    return islands.simulate.run(main, islands=islands_)


@pytest.mark.slow  # transformers' import and dynamo's tracing: make test, not make test-fast
@pytest.mark.parametrize("m", [2, 3])  # 3: a full window steps DiLoCo's sqrt(2) on the mean (ps.WINDOWED_LR)
def test_a_transformerstiny_gpt2_through_held_windows_trains_as_diloco(m):
    pytest.importorskip("transformers")
    held = _fit(tiny_gpt2, lm_loss, tokens(), "ps", islands_=m)
    sync = _fit(tiny_gpt2, lm_loss, tokens(), "diloco", islands_=m)
    assert all(torch.equal(held[0], h) for h in held[1:])  # every island ends on the server's model
    torch.testing.assert_close(held[0], sync[0], rtol=1e-5, atol=1e-6)
    assert not torch.equal(held[0], torch.cat([p.detach().reshape(-1) for p in tiny_gpt2().parameters()]))  # it trained


@pytest.mark.slow
def test_a_compiled_model_through_held_windows_trains_as_its_eager_self_and_as_diloco():
    eager = _fit(small_net, F.cross_entropy, rows(), "ps")
    compiled = _fit(small_net, F.cross_entropy, rows(), "ps", compile=Compile(backend="aot_eager"))
    sync = _fit(small_net, F.cross_entropy, rows(), "diloco")
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(compiled[0], sync[0], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_models_we_did_not_write_pull_compressed_answers_and_end_on_the_servers_exact_model():
    """Compressed pulls (ps_pulls) under islands.Trainer: a transformers GPT-2 (fp16 answers) and a compiled model
    (int8 answers) train from the copies the server holds for them, every island ends on the server's exact model
    (the final answer is whole), near the run whose answers were whole; the compiled run equals its eager self."""
    pytest.importorskip("transformers")
    gpt = _fit(tiny_gpt2, lm_loss, tokens(), "ps", pulls="fp16")
    whole = _fit(tiny_gpt2, lm_loss, tokens(), "ps")
    assert all(torch.equal(gpt[0], g) for g in gpt[1:])
    torch.testing.assert_close(gpt[0], whole[0], rtol=0, atol=1e-3)  # fp16 steps, their rounding fed back
    eager = _fit(small_net, F.cross_entropy, rows(), "ps", pulls="int8")
    compiled = _fit(small_net, F.cross_entropy, rows(), "ps", compile=Compile(backend="aot_eager"), pulls="int8")
    assert all(torch.equal(eager[0], e) for e in eager[1:]) and all(torch.equal(compiled[0], c) for c in compiled[1:])
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=1e-7)
    exact = _fit(small_net, F.cross_entropy, rows(), "ps")
    assert not torch.equal(eager[0], exact[0])  # the int8 answers moved what the islands trained from
