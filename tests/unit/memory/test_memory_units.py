"""islands.memory: exact saved-tensor accounting, checkpointing, bf16 autocast, micro-batches, the sizer."""

import re

import pytest
import torch

from islands.memory import (
    ForwardBackward,
    SavedTensorMeter,
    activation_peak,
    plan_micro_batch,
    split_segments,
    sqrt_segments,
    state_bytes,
    synthetic_batches,
)
from islands.models import MLP, ByteTransformer, sequence_loss

CONTEXT = 16


def tiny(seed=0, layers=2):
    torch.manual_seed(seed)
    return ByteTransformer(d_model=32, n_layers=layers, n_heads=2, context=CONTEXT)


def batch(b=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, (b, CONTEXT + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def grads_after(model, step, x, y):
    step(model, (x, y), sequence_loss)
    return [p.grad.clone() for p in model.parameters()]


def test_meter_counts_saved_bytes_exactly_and_releases_them_after_backward():
    w = torch.nn.Parameter(torch.randn(8, 4))
    x = torch.randn(5, 8, requires_grad=True)
    with SavedTensorMeter(exclude=[w]) as meter:
        h = x @ w  # mm saves x (160 B) and w (a parameter: excluded)
        y = torch.tanh(h)  # tanh saves its output (80 B)
        assert meter.live == 5 * 8 * 4 + 5 * 4 * 4
        y.sum().backward()
    assert meter.peak == 240
    assert meter.live == 0  # autograd released everything it held


def test_meter_counts_a_storage_once_however_many_views_are_saved():
    x = torch.randn(4, 6, requires_grad=True)
    with SavedTensorMeter() as meter:
        z = x * 2  # saves nothing of size (scalar other)
        a, b = z[:, :3], z[:, 3:]
        (a * b).sum().backward()  # saves both views of z's storage
    assert meter.peak == 4 * 6 * 4


def test_checkpointing_gives_the_same_gradients_and_holds_less():
    x, y = batch()
    plain, ckpt = tiny(), tiny()
    ckpt.set_activation_checkpointing(2)
    step = ForwardBackward()
    for a, b in zip(grads_after(plain, step, x, y), grads_after(ckpt, step, x, y)):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    make = synthetic_batches("lm", CONTEXT)
    held = {k: activation_peak(tiny(layers=4), sequence_loss, make, 8, step) for k in (0,)}
    for seg in (1, 2, 4):
        m = tiny(layers=4)
        m.set_activation_checkpointing(seg)
        held[seg] = activation_peak(m, sequence_loss, make, 8, step)
    assert held[4] < held[2] < held[0]  # a block holds more inside than at its boundary (docs/memory.md)
    assert held[1] < held[0]


def test_checkpointing_is_off_in_eval_and_rejects_bad_segment_counts():
    m = tiny()
    with pytest.raises(ValueError, match=re.escape("segments must be in 1..2")):
        m.set_activation_checkpointing(3)
    assert split_segments(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert sqrt_segments(16) == 4 and sqrt_segments(1) == 1
    m.set_activation_checkpointing(2)
    m.eval()
    with torch.no_grad():
        assert torch.equal(m(batch()[0]), tiny().eval()(batch()[0]))


def test_bf16_autocast_trains_with_fp32_parameters_and_holds_less():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = ForwardBackward(precision="bf16")
    x, y = batch(8)
    losses = []
    for _ in range(15):
        losses.append(step(model, (x, y), sequence_loss).item())
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        opt.step()
        opt.zero_grad()
    assert losses[-1] < 0.7 * losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    make = synthetic_batches("lm", CONTEXT)
    fp32 = activation_peak(tiny(), sequence_loss, make, 16, ForwardBackward())
    bf16 = activation_peak(tiny(), sequence_loss, make, 16, step)
    assert bf16 < 0.8 * fp32


@pytest.mark.parametrize("micro", [1, 2, 4])  # 6 = 6x1, 3x2, 4+2 (an uneven last piece)
def test_accumulated_micro_batches_equal_the_whole_batch(micro):
    x, y = batch(6)
    whole = grads_after(tiny(), ForwardBackward(), x, y)
    model = tiny()
    step = ForwardBackward(micro_batch=micro)
    loss = step(model, (x, y), sequence_loss)
    assert step.pieces(6) == {1: [1] * 6, 2: [2, 2, 2], 4: [4, 2]}[micro]
    for a, b in zip(whole, [p.grad for p in model.parameters()]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert abs(loss.item() - sequence_loss(tiny()(x), y).item()) < 1e-5


def test_micro_batches_work_for_the_digits_mlp():
    torch.manual_seed(0)
    x, y = torch.randn(10, 64), torch.randint(0, 10, (10,))
    torch.manual_seed(0)
    a = MLP()
    torch.manual_seed(0)
    b = MLP()
    ForwardBackward()(a, (x, y), torch.nn.functional.cross_entropy)
    ForwardBackward(micro_batch=3)(b, (x, y), torch.nn.functional.cross_entropy)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)


def test_sizer_picks_the_largest_micro_batch_under_the_budget():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters())
    make = synthetic_batches("lm", CONTEXT)
    state = state_bytes(model, opt)
    assert state.optimizer == 2 * state.params  # AdamW's two moments, before its first step
    one = activation_peak(model, sequence_loss, make, 1, ForwardBackward())
    budget = state.total + 5 * one  # room for a few samples, not the whole batch of 16
    plan = plan_micro_batch(model, sequence_loss, make, 16, budget, opt)
    assert 1 < plan.micro_batch < 16
    assert plan.total_bytes <= budget
    assert plan.peak_bytes == activation_peak(model, sequence_loss, make, plan.micro_batch, ForwardBackward())
    bigger = activation_peak(model, sequence_loss, make, plan.micro_batch + 1, ForwardBackward())
    assert state.total + bigger > budget  # one more sample would not fit
    assert all(p.grad is None for p in model.parameters())  # sizing leaves no gradients behind
    roomy = plan_micro_batch(model, sequence_loss, make, 16, 10 * budget, opt)
    assert roomy.micro_batch == 16  # never more than the batch
    ckpt = tiny()
    ckpt.set_activation_checkpointing(2)
    assert plan_micro_batch(ckpt, sequence_loss, make, 16, budget, opt).micro_batch > plan.micro_batch


def test_sizer_says_what_would_fit_when_one_sample_does_not():
    model = tiny()
    make = synthetic_batches("lm", CONTEXT)
    budget = state_bytes(model).total  # parameters and grads alone fill it
    with pytest.raises(ValueError, match=r"does not fit one sample.*raise the budget to at least"):
        plan_micro_batch(model, sequence_loss, make, 8, budget)
    with pytest.raises(ValueError, match="budget_bytes must be > 0"):
        plan_micro_batch(model, sequence_loss, make, 8, 0)


def test_step_rejects_bad_arguments():
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16"):
        ForwardBackward(precision="fp16")
    with pytest.raises(ValueError, match="micro_batch must be >= 0"):
        ForwardBackward(micro_batch=-1)
