"""Error-feedback accounting, bitwise resume, DGC corrections, 1-bit Adam."""

import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st

from islands.compress import (
    QSGD,
    Cast,
    ErrorFeedback,
    NaiveCompressedAdam,
    OneBitAdam,
    PowerSGD,
    RandomK,
    ScaledSign,
    SharedScaleQuant,
    TopK,
    deep_gradient_compression,
    parse_compressor,
)

# Error feedback takes contractive compressors only (see the refusal test below for the others).
INNERS = [
    lambda: TopK(0.1),
    lambda: SharedScaleQuant(4, seed=3),
    lambda: PowerSGD(2),
    lambda: ScaledSign(),
    lambda: Cast(torch.float16),
]


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 4), st.integers(0, 2**31), st.integers(1, 4))
def test_error_feedback_accounting(which, seed, steps):
    ef = ErrorFeedback(INNERS[which]())
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        grad = torch.randn(6, 10, generator=g)
        state = ef.state("w", grad)
        before = state["residual"].clone()
        sent = ef.decompress(ef.compress(grad, state))
        incoming = grad + before
        # sent + residual == input within fp32 rounding: 2^-23 (|sent| + |input|) per entry
        err = (sent + ef.states["w"]["residual"] - incoming).abs()
        assert torch.all(err <= (sent.abs() + incoming.abs()) * 2**-23)
        if which == 0:  # sparsifier: exact
            assert torch.equal(sent + ef.states["w"]["residual"], incoming)


def test_residual_survives_zero_grad_and_lives_outside_grad():
    model = torch.nn.Linear(8, 4)
    ef = parse_compressor("topk:ratio=0.1,warmup=0")
    model(torch.randn(3, 8)).sum().backward()
    grad = model.weight.grad.clone()
    ef.compress(model.weight.grad, ef.state("weight", model.weight.grad))
    assert torch.equal(model.weight.grad, grad)  # the gradient is not modified
    residual = ef.states["weight"]["residual"].clone()
    model.zero_grad()
    assert torch.equal(ef.states["weight"]["residual"], residual) and residual.abs().sum() > 0


@pytest.mark.parametrize(
    "spec",
    [
        "powersgd:rank=2",
        "topk:ratio=0.05,warmup=1,stage_steps=1,momentum=0.9,clip=5",
        "randomk:ratio=0.1",
        "qsgd:levels=4",
        "int4:ef=1",
        "sign",
        "topkq:ratio=0.1,bits=2,chunk=32,decay=0.9",
        "dct-topk:ratio=0.1,block=8",
        "randomk-shared:ratio=0.1",
    ],
)
def test_bitwise_resume(spec):
    g = torch.Generator().manual_seed(0)
    grads = [{"a": torch.randn(12, 9, generator=g), "b": torch.randn(9, generator=g)} for _ in range(4)]
    run = parse_compressor(spec)
    for step in grads[:3]:
        for n, t in step.items():
            run.compress(t, run.state(n, t))
    saved = copy.deepcopy(run.state_dict())
    resumed = parse_compressor(spec)
    resumed.load_state_dict(saved)
    for n, t in grads[3].items():
        p1 = run.compress(t, run.state(n, t))
        p2 = resumed.compress(t, resumed.state(n, t))
        assert all(torch.equal(x, y) for x, y in zip(p1.tensors + p1.shared, p2.tensors + p2.shared)), (spec, n)
        if "residual" in run.states[n]:  # error-fed; the others' state is their generator
            assert torch.equal(run.states[n]["residual"], resumed.states[n]["residual"])
    # and a fresh object (no resume) would have sent something else: the test can fail
    fresh = parse_compressor(spec)
    t = grads[3]["a"]
    p3 = fresh.compress(t, fresh.state("a", t))
    assert not all(torch.equal(x, y) for x, y in zip(p1.tensors, p3.tensors)) or spec.startswith("sign")


def test_powersgd_q_is_keyed_by_name_and_resumes():
    c = PowerSGD(3)
    a, b = torch.randn(10, 8), torch.randn(10, 8)
    c.compress(a, c.state("layer1", a))
    c.compress(b, c.state("layer2", b))
    assert set(c.states) == {"layer1", "layer2"}
    sd = c.state_dict()
    c2 = PowerSGD(3)
    c2.load_state_dict(sd)
    assert torch.equal(c2.states["layer1"]["Q"], c.states["layer1"]["Q"])


def test_dgc_momentum_correction_and_masking():
    c = deep_gradient_compression(ratio=0.25, momentum=0.5, warmup=False)
    g = torch.tensor([4.0, 1.0, 0.5, 0.25])
    st_ = c.state("w", g)
    sent = c.decompress(c.compress(g, st_))
    assert torch.equal(sent, torch.tensor([4.0, 0, 0, 0]))
    assert torch.equal(st_["momentum"], torch.tensor([0.0, 1.0, 0.5, 0.25]))  # masked where sent
    sent = c.decompress(c.compress(g, st_))
    # u = 0.5 u + g = [4, 1.5, .75, .375]; v = residual + u = [4, 2.5, 1.25, .625] -> send 4
    assert torch.equal(sent, torch.tensor([4.0, 0, 0, 0]))
    assert torch.equal(st_["residual"], torch.tensor([0.0, 2.5, 1.25, 0.625]))
    clipped = deep_gradient_compression(ratio=1.0, momentum=0.0, clip_norm=1.0, warmup=False)
    out = clipped.decompress(clipped.compress(torch.tensor([3.0, 4.0]), clipped.state("w", torch.zeros(2))))
    assert torch.allclose(out, torch.tensor([0.6, 0.8]))


def _train(opt_cls, steps=60, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(128, 10)
    y = x[:, :1] * 2 - x[:, 1:2]
    opt = opt_cls(model.parameters(), lr=0.01, **kw)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y)), opt


def test_onebit_adam_freezes_variance_and_trains():
    base, _ = _train(torch.optim.Adam, steps=0)
    loss, opt = _train(OneBitAdam, warmup_steps=10)
    assert loss < 0.5 * base
    p = next(iter(opt.state))
    v = opt.state[p]["exp_avg_sq"].clone()
    _, opt2 = _train(OneBitAdam, steps=10, warmup_steps=10)
    assert torch.equal(opt2.state[next(iter(opt2.state))]["exp_avg_sq"], v)  # nothing changed v after warm-up
    assert opt.state[p]["error"].abs().sum() > 0  # error compensation is active
    sd = opt.state_dict()
    assert "error" in sd["state"][0]


def test_naive_compressed_adam_is_the_control():
    loss, opt = _train(NaiveCompressedAdam, warmup_steps=10)
    assert opt.state[next(iter(opt.state))]["step"] == 60
    assert "NEGATIVE CONTROL" in NaiveCompressedAdam.__doc__
    with pytest.raises(ValueError):
        OneBitAdam(torch.nn.Linear(2, 2).parameters(), warmup_steps=0)


@pytest.mark.parametrize("spec", ["randomk:ratio=0.1,ef=1", "qsgd:levels=4,ef=1"])
def test_error_feedback_refuses_compressors_that_rescale_to_stay_unbiased(spec):
    with pytest.raises(ValueError, match="contractive"):
        parse_compressor(spec)
    with pytest.raises(ValueError, match="contractive"):
        ErrorFeedback(RandomK(0.1) if spec.startswith("randomk") else QSGD(4))


@pytest.mark.parametrize(
    "spec",
    [
        "topk:ratio=0.01,warmup=0",
        "int4:ef=1",
        "int8:ef=1",
        "fp16:ef=1",
        "sign",
        "powersgd:rank=1",
        "topkq:ratio=0.01,bits=2,chunk=1024",
        "dct-topk:ratio=0.01",
        "randomk-shared:ratio=0.01",
    ],
)
def test_error_feedback_residual_stays_bounded_for_contractive_compressors(spec):
    """Feeding the same gradient 300 times: what was not sent accumulates, but a contractive compressor
    sends more as the residual grows, so it stays within a multiple of the input (the 1/delta bound)."""
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(1))
    c = parse_compressor(spec)
    norms = []
    for _ in range(300):
        st = c.state("w", x)
        c.compress(x, st)
        norms.append(float(st["residual"].norm() / x.norm()))
    # growth levels off (a non-contractive one grows geometrically: ~1e11 x the input by round 64)
    assert norms[-1] - norms[-100] <= 0.5 * (norms[99] - norms[0]) + 0.05, (norms[0], norms[99], norms[-100], norms[-1])
    assert max(norms) < 1000  # topk at 1% sends 31 of 3072 entries a round: delta = 0.01
