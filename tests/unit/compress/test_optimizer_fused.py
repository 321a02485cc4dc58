"""islands' AdamW asks for torch's fused kernel when every parameter is on CUDA, and leaves the CPU on torch's
default path, whose results earlier runs are compared with bit for bit (islands.optim.fused)."""

from __future__ import annotations

import pytest
import torch

from islands.compress import optim as compress_optim
from islands.compress.optim import build_optimizer
from islands.optim import MuonAdamW
from islands.optim.fused import fused_adamw


class _OnCuda:
    """Stands for a CUDA parameter on a machine without one: fused_adamw reads only the device."""

    device = torch.device("cuda")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_fused_only_when_every_parameter_is_on_cuda():
    cpu = torch.zeros(2)
    assert fused_adamw([_OnCuda(), _OnCuda()]) is True
    assert fused_adamw([_OnCuda(), cpu]) is None  # mixed: torch's own choice
    assert fused_adamw([cpu]) is None
    assert fused_adamw([]) is None
    assert fused_adamw([{"params": [cpu]}, {"params": cpu}]) is None  # parameter groups, a lone tensor in one


def test_the_cpu_keeps_torchs_default_adamw():
    model = _model()
    opt = build_optimizer("adamw", model.parameters(), lr=1e-3)
    assert opt.defaults["fused"] is None
    muon = build_optimizer("muon", None, lr=1e-3, model=model)
    assert isinstance(muon, MuonAdamW)
    assert all(group.get("fused") is None for group in muon.param_groups if group["kind"] == "adamw")


def test_the_builder_passes_what_fused_adamw_decides(monkeypatch):
    # torch 2.13 has a CPU fused kernel, so the builder's side of the CUDA case can run here
    monkeypatch.setattr(compress_optim, "fused_adamw", lambda params: True)
    model = _model()
    opt = build_optimizer("adamw", model.parameters(), lr=1e-3)
    assert opt.defaults["fused"] is True
    assert len(opt.param_groups[0]["params"]) == 4  # the generator was read once for the device, once for torch


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_parameters_get_fused_adamw_and_it_steps():
    model = _model().cuda()
    opt = build_optimizer("adamw", model.parameters(), lr=1e-3)
    muon = MuonAdamW.for_model(_model().cuda(), lr=1e-3)
    assert opt.defaults["fused"] is True
    assert all(group["fused"] is True for group in muon.param_groups if group["kind"] == "adamw")
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(3, 4, device="cuda")).sum().backward()
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
