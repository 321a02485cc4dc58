"""Warm start (warm_start=W): W steps of ordinary data parallelism across islands, then the outer rounds.

Stated equivalence: during the warm-up every island steps AdamW with the gradient
    g = sum_i (g_i / M)            (M islands; divide first, as torch's DDP does)
so every island holds the same parameters and Adam moments as one process that averages the
islands' gradients itself and steps one AdamW: we require them bit for bit (two islands: the sum of
two halves does not depend on the order). After step W-1 the outer strategy starts from that model
and runs its rounds over the last T - W steps, its own clock starting at 0.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from harness.outer import batch, run_world, tiny_model

TOTAL, WARM, H = 7, 3, 2  # rounds after the warm-up end at local steps 2, 4 (shortened final round)


def loss_of(model, b):
    from islands.models import sequence_loss

    return sequence_loss(model(b[:, :-1]), b[:, 1:])


class Run:
    """Model, AdamW, a warm-started outer strategy, stepped in the trainer's hook order."""

    def __init__(self, world, spec: str):
        from islands.sync.outer import make_outer

        self.world, self.model = world, tiny_model()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.strategy = make_outer(spec)
        self.strategy.wrap(self.model, self.opt, world)

    def step(self, i: int) -> None:
        loss_of(self.model, batch(self.world.rank, i)).backward()
        self.strategy.after_backward(self.model, i)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.strategy.after_step(self.model, self.opt, i)

    def finish(self) -> None:
        self.strategy.finish(self.model)  # after the last step: the final (shortened) round

    def flat(self) -> np.ndarray:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()]).numpy().copy()


def reference_warm(size: int, steps: int) -> np.ndarray:
    """One process: average the islands' gradients (divide, then sum in rank order) and step one AdamW."""
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(steps):
        grads = []
        for r in range(size):
            model.zero_grad(set_to_none=True)
            loss_of(model, batch(r, i)).backward()
            grads.append([p.grad.clone() / size for p in model.parameters()])
        for j, p in enumerate(model.parameters()):
            p.grad = sum((grads[r][j] for r in range(1, size)), grads[0][j].clone())
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def _scenario(world) -> dict:
    out = {}
    before = world.ledger.snapshot()
    run = Run(world, f"diloco:inner_steps={H},warm_start={WARM}")
    warm_models, evals_live = [], []
    for i in range(TOTAL):
        run.step(i)
        if i < WARM:
            warm_models.append(run.flat())
            evals_live.append(run.strategy.eval_model(run.model) is run.model)
        if i == WARM - 1:  # the switch: the global model starts as the live one
            out["switch_global"] = run.strategy.outer.global_flat.numpy().copy()
    run.finish()
    after = world.ledger.snapshot()
    out["sent"] = {k: after["sent"].get(k, 0) - before["sent"].get(k, 0) for k in after["sent"]}
    out["calls"] = {k: after["calls"].get(k, 0) - before["calls"].get(k, 0) for k in after["calls"]}
    out["warm_models"], out["evals_live"] = warm_models, evals_live
    out["eval_is_global_after"] = run.strategy.eval_model(run.model) is run.strategy.outer.global_model
    out["rounds"] = run.strategy.outer.rounds
    out["global"] = run.strategy.outer.global_flat.numpy().copy()
    out["numel"] = run.strategy.outer.global_flat.numel()
    # Resume: a state round trip in the warm phase and one in the rounds give the same end model; LIT-212's outer
    # step, so that the rounds carry a Nesterov momentum buffer (the default step has none).
    resume_spec = f"diloco:inner_steps={H},warm_start={WARM},outer=nesterov,outer_lr=0.7,momentum=0.9"
    for cut in (2, 5):
        a = Run(world, resume_spec)
        for i in range(cut):
            a.step(i)
        snap = copy.deepcopy(
            {"model": a.model.state_dict(), "opt": a.opt.state_dict(), "strategy": a.strategy.state_dict()}
        )
        for i in range(cut, TOTAL):
            a.step(i)
        a.finish()
        b = Run(world, resume_spec)
        b.model.load_state_dict(snap["model"])
        b.opt.load_state_dict(snap["opt"])
        b.strategy.load_state_dict(snap["strategy"])
        for i in range(cut, TOTAL):
            b.step(i)
        b.finish()
        out[f"resume{cut}"] = (a.strategy.outer.global_flat.numpy().copy(), b.strategy.outer.global_flat.numpy().copy())
    # streaming takes the same warm start
    s = Run(world, "streaming-diloco:inner_steps=4,fragments=2,tau=1,block=16,warm_start=2")
    for i in range(9):
        s.step(i)
    s.finish()
    out["streaming_global"] = s.strategy.outer.global_flat.numpy().copy()
    out["streaming_sends"] = list(s.strategy.outer.schedule.sends)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_world(_scenario, size=2, islands=2)


def test_warm_phase_is_bitwise_data_parallel_adamw(ranks):
    for i in range(WARM):
        ref = reference_warm(2, i + 1)
        for r in ranks:
            np.testing.assert_array_equal(r["warm_models"][i], ref)


def test_warm_phase_evaluates_the_live_model_then_the_global_one(ranks):
    for r in ranks:
        # the live model until the last warm step; from its end on, the outer strategy's global model,
        # which starts as exactly the warm-started one
        assert r["evals_live"] == [True] * (WARM - 1) + [False]
        np.testing.assert_array_equal(r["switch_global"], r["warm_models"][-1])
        assert r["eval_is_global_after"]


def test_warm_bytes_and_rounds_are_counted_apart(ranks):
    for r in ranks:
        p = r["numel"]
        assert r["calls"]["outer_warm_grad"] == WARM
        assert r["sent"]["outer_warm_grad"] == WARM * 4 * p
        rounds = -(-(TOTAL - WARM) // H)  # the last, shortened round included
        assert r["rounds"] == rounds
        assert r["calls"]["outer_delta"] == rounds
        assert r["sent"]["outer_delta"] == rounds * 4 * p


def test_ranks_agree_bitwise_and_resume_is_exact(ranks):
    np.testing.assert_array_equal(ranks[0]["global"], ranks[1]["global"])
    np.testing.assert_array_equal(ranks[0]["streaming_global"], ranks[1]["streaming_global"])
    for r in ranks:
        for cut in (2, 5):
            a, b = r[f"resume{cut}"]
            np.testing.assert_array_equal(a, b)


def test_streaming_rounds_start_after_the_warm_up(ranks):
    # 7 steps after a 2-step warm-up, H=4, F=2: fragment 0 sends at local 2 and 6, fragment 1 at 4,
    # and the final flush sends both once more.
    for r in ranks:
        assert r["streaming_sends"] == [3, 2]


def test_warm_start_spec_errors():
    from islands.sync.outer import WarmStart, make_outer, parse_outer

    with pytest.raises(ValueError, match="warm_start must be >= 0"):
        parse_outer("diloco:warm_start=-1")
    # a warm start as long as the run: refused by islands.app.validate (strategies no longer know the run's
    # length; test_warm_start_as_long_as_the_run_is_refused_before_any_worker_starts)
    with pytest.raises(ValueError, match="local-sgd does not take warm_start"):
        parse_outer("local-sgd:every=4,warm_start=10")
    with pytest.raises(ValueError, match="warm-start steps must be >= 1"):
        WarmStart(make_outer("diloco"), 0)
    with pytest.raises(TypeError, match="wraps an OuterStrategy"):
        WarmStart(object(), 3)
    s = make_outer("diloco:inner_steps=10,warm_start=40")
    assert isinstance(s, WarmStart) and s.steps == 40 and s.outer.inner_steps == 10
    assert not isinstance(make_outer("diloco:inner_steps=10"), WarmStart)


def test_warm_start_as_long_as_the_run_is_refused_before_any_worker_starts():
    from islands.app.validate import validate
    from islands.config import ConfigError, from_mapping

    with pytest.raises(ConfigError, match=r"warm_start \(50\) must be < train.steps \(50\)"):
        validate(
            from_mapping({"workers": 2, "islands": 2, "steps": 50, "outer": "diloco:inner_steps=10,warm_start=50"})
        )
    assert (
        validate(
            from_mapping({"workers": 2, "islands": 2, "steps": 50, "outer": "diloco:inner_steps=10,warm_start=49"})
        ).train.steps
        == 50
    )
