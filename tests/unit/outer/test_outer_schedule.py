"""outer_schedule=inner: the outer step shrinks with the inner optimizer's scheduled lr."""

from __future__ import annotations

import pytest
import torch

from islands.runtime.world import World
from islands.sync.outer import make_outer


def _outer_step(schedule: str, inner_lr_now: float) -> torch.Tensor:
    from islands.models import MLP

    torch.manual_seed(0)
    model = MLP(8, 16, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)  # built at the peak lr, as the trainer does
    s = make_outer(f"diloco:inner_steps=1,outer=sgd,outer_lr=1,momentum=0,outer_schedule={schedule}")
    s.wrap(model, opt, World.single())
    start = s.global_flat.clone()
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()  # the inner step at the peak lr; the schedule then moves the lr before the outer step
    for g in opt.param_groups:
        g["lr"] = inner_lr_now
    s.after_step(model, opt, 0)
    return s.global_flat - start


def test_inner_schedule_scales_the_outer_step_by_lr_now_over_lr_at_build():
    constant = _outer_step("constant", 0.05)
    follows = _outer_step("inner", 0.05)
    assert constant.abs().max() > 0
    assert torch.allclose(follows, 0.25 * constant, rtol=0, atol=1e-6)  # 0.05 / 0.2; fp32 global - delta rounds
    assert torch.equal(_outer_step("inner", 0.2), constant)  # at the peak: unchanged


def test_bad_outer_schedule_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="outer_schedule must be 'constant' or 'inner', got 'cosine'"):
        make_outer("diloco:outer_schedule=cosine")
    with pytest.raises(ValueError, match="outer_schedule"):
        make_outer("streaming-diloco:inner_steps=4,fragments=2,outer_schedule=linear")
