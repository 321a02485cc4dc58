"""DiLoCo's `statistics` option: mean (the default) averages the islands' BatchNorm statistics at every round, own
keeps each island's through the end, on the same global parameters (islands whose inputs differ; the parameter
server's `statistics=own` is the same choice, test_ps_buffers.py). Two simulated islands whose data have their own
mean and spread."""

from __future__ import annotations

import pytest
import torch

import islands
from islands.outer import DiLoCo, StreamingDiLoCo
from islands.sync.outer import make_outer


def bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Linear(6, 2))


def batch(island: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * island + step)
    return torch.randn(16, 3, generator=g) * (1 + 2 * island) + 3 * island, torch.randint(0, 2, (16,), generator=g)


def floating_buffers(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([b.reshape(-1) for b in model.buffers() if b.is_floating_point()])


def train(spec: str, steps: int = 6):
    """Each island's (buffers after its last local step, buffers of the model the job evaluates, its parameters)."""

    def main(world):
        torch.set_num_threads(1)
        strategy = make_outer(spec)
        model = bn_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        strategy.wrap(model, opt, world)
        for i in range(steps):
            x, y = batch(world.rank, i)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            strategy.after_step(model, opt, i)
        own = floating_buffers(model).clone()
        strategy.finish(model)
        evaluated = strategy.eval_model(model)
        params = torch.cat([p.detach().reshape(-1) for p in evaluated.parameters()])
        return own, floating_buffers(evaluated).clone(), params

    return islands.simulate.run(main, islands=2)


@pytest.mark.parametrize("spec", ["diloco:inner_steps=3", "streaming-diloco:inner_steps=4,fragments=2,tau=1"])
def test_statistics_own_keeps_each_islands_buffers_and_mean_averages_them(spec):
    own = train(f"{spec},statistics=own")
    for last_local, evaluated, _ in own:
        assert torch.equal(evaluated, last_local)  # the island's own statistics, untouched by the syncs
    assert not torch.allclose(own[0][1], own[1][1])  # different data, different statistics
    assert torch.equal(own[0][2], own[1][2])  # the same global parameters

    mean = train(spec)
    assert torch.allclose(mean[0][1], mean[1][1])  # one model: the islands' mean
    assert torch.allclose(mean[0][1], (mean[0][0] + mean[1][0]) / 2, atol=1e-6)
    # the parameters do not depend on where the statistics went (the syncs average parameters either way)
    assert torch.allclose(own[0][2], mean[0][2])


def test_statistics_is_checked_in_the_constructor_and_the_spec():
    assert DiLoCo(3, statistics="own").buffer_policy == "own"
    assert StreamingDiLoCo(4, statistics="own").buffer_policy == "own"
    assert DiLoCo(3).buffer_policy == "average"
    with pytest.raises(ValueError, match="statistics must be one of mean, own, got 'island'"):
        DiLoCo(3, statistics="island")
    with pytest.raises(ValueError, match="statistics must be one of mean, own"):
        make_outer("diloco:inner_steps=3,statistics=shared")
