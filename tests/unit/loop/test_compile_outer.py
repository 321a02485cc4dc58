"""A model compiled with torch.compile under every outer strategy and every outer compressor (issue #34;
docs/own-model.md, "Compiled models"): two simulated islands train it through islands.Trainer compiled before
`wrap` (the user's torch.compile, handed to the Trainer) and after it (`Trainer(compile=...)`), and end where the
eager run ends, losses and every island's global model, within fp32 tolerance. aot_eager: islands' plumbing (the
`_orig_mod.` names the compressors key their state by, the parameters the strategies average), not inductor's code,
is under test; tests/unit/loop/test_compile.py has DiLoCo, streaming DiLoCo and the inductor run."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import islands
from islands.runtime.compiled import Compile
from islands.sync.outer import make_outer

BACKEND = "aot_eager"
STEPS = 6

# every outer strategy but diloco (test_compile.py, and below with every compressor) and ps (test_ps_wait_models.py)
OUTER = [
    "local-sgd:every=2",
    "post-local-sgd:switch=2,every=2",  # averaging every step until step 2, then every 2
    "overlap-local-sgd:tau=2",  # the average in flight on the exchange thread while the next steps run
    "slowmo:every=2",
    "easgd:every=2",
    "gossip:every=2",
    "gossip:every=2,compressor=(topk:ratio=0.25,warmup=0)",  # choco: per-edge estimates, keyed by parameter name
    # streaming DiLoCo with a compressor instead of its 4-bit quantiser, in both compile orders (test_compile.py:
    # quant4, compiled after wrap)
    "streaming-diloco:inner_steps=4,fragments=2,bits=32,compressor=(topkq:ratio=0.1,bits=2,chunk=64)",
]
# every compressor of docs/compression.md on DiLoCo's pseudo-gradients
COMPRESSORS = [
    "fp16",
    "bf16",
    "int8",
    "int4",
    "qsgd",
    "randomk:ratio=0.25",
    "randomk-shared:ratio=0.25",
    "topk:ratio=0.25",
    "sign",
    "topkq:ratio=0.1,bits=2,chunk=64",
    "dct-topk:ratio=0.25,block=16,chunk=64",
    "powersgd:rank=2",  # per-parameter projections seeded by name
]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _rows() -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(96, 8, generator=g)
    return TensorDataset(x, (x @ torch.randn(8, 4, generator=g)).argmax(-1))


def _tensors(tree, path: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a strategy's state_dict (what its checkpoint holds: global model, error-feedback residuals,
    per-edge estimates, outer momentum) by their path in it."""
    if isinstance(tree, torch.Tensor):
        return {path: tree.detach().clone()}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return {k: v for key, sub in items for k, v in _tensors(sub, f"{path}/{key}").items()}


def _fit(spec: str, mode: str) -> list[dict]:
    """2 simulated islands, the model eager (mode "eager") or compiled "before" or "after" wrap; each island's
    losses, global model, what it sent, its strategy's state, and the graphs torch compiled."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # compile afresh: a graph cached by an earlier case would compile nothing here
    counters.clear()

    def main(world):
        torch.manual_seed(0)
        model: nn.Module = _Net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if mode == "before":
            model = torch.compile(model, backend=BACKEND)
        trainer = islands.Trainer(
            model,
            opt,
            F.cross_entropy,
            _rows(),
            batch_size=8,
            strategy=islands.Stack(outer=make_outer(spec)),
            world=world,
            log_every=1,
            compile=Compile(backend=BACKEND) if mode == "after" else None,
        )
        trainer.fit(STEPS)
        glob = trainer.strategy.eval_model(trainer.model)
        return {
            "losses": [e["loss"] for e in trainer.series["train"]],
            "model": {k: v.detach().clone() for k, v in glob.state_dict().items()},
            "sent": dict(world.ledger.snapshot()["sent"]),
            "state": _tensors(trainer.strategy.state_dict()),
        }

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        runs = islands.simulate.run(main, islands=2)
    finally:
        torch.set_num_threads(threads)
    graphs = counters["stats"]["unique_graphs"]
    return [dict(r, graphs=graphs) for r in runs]


def _assert_compiled_runs_match_eager(spec: str) -> list[dict]:
    eager = _fit(spec, "eager")
    assert eager[0]["graphs"] == 0
    assert any(eager[0]["sent"].values()), f"{spec}: the islands exchanged nothing"
    for mode in ("before", "after"):
        for island, (e, c) in enumerate(zip(eager, _fit(spec, mode))):
            what = f"{spec}, compiled {mode} wrap, island {island}"
            assert c["graphs"] >= 1, what  # compiled, not an eager fallback
            assert len(c["losses"]) == STEPS, what
            torch.testing.assert_close(c["losses"], e["losses"], rtol=1e-5, atol=1e-6, msg=what)
            assert list(c["model"]) == list(e["model"]), what  # the eager names, no _orig_mod. prefix
            for k, v in e["model"].items():
                torch.testing.assert_close(c["model"][k], v, rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")
            assert c["sent"] == e["sent"], what  # the same exchanges, the same bytes
            assert list(c["state"]) == list(e["state"]), what  # what the strategy checkpoints ...
            for k, v in e["state"].items():  # ... holds the same values
                torch.testing.assert_close(c["state"][k], v, rtol=1e-5, atol=1e-6, msg=f"{what}: state {k}")
    return eager


@pytest.mark.slow  # dynamo traces the model twice a case (~1 s of CPU each): make test, not make test-fast
@pytest.mark.parametrize("spec", OUTER)
def test_compiled_model_trains_as_the_eager_one_under_every_outer_strategy(spec):
    eager = _assert_compiled_runs_match_eager(spec)
    torch.manual_seed(0)
    start = _Net().state_dict()
    assert any(not torch.equal(eager[0]["model"][k], start[k]) for k in start)  # it trained
    if not spec.startswith("gossip"):  # the averaging strategies end every island on one global model
        for k, v in eager[0]["model"].items():
            torch.testing.assert_close(eager[1]["model"][k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # dynamo traces the model twice a case (~1 s of CPU each): make test, not make test-fast
@pytest.mark.parametrize("compressor", COMPRESSORS, ids=[c.split(":")[0] for c in COMPRESSORS])
def test_compiled_model_trains_as_the_eager_one_under_diloco_with_every_compressor(compressor):
    spec = f"diloco:inner_steps=2,compressor=({compressor})"
    eager = _assert_compiled_runs_match_eager(spec)
    plain = _fit("diloco:inner_steps=2", "eager")[0]
    assert eager[0]["sent"] != plain["sent"]  # the compressor is what the exchange sent
