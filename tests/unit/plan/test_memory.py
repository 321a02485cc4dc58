"""Memory predictions against what a short simulated run actually holds: the tensors reachable from each island's
model, optimizer and strategy (islands.plan.held), plus the saved-for-backward peak of one of its steps."""

import pytest
import torch

from islands.config import from_mapping
from islands.plan import Topology, parse_link, predict
from islands.plan.api import candidate, job_config, profile_job
from islands.plan.held import held_bytes, simulated_held_peak


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ISLANDS_PLAN_CACHE", str(tmp_path / "cache"))


def test_held_bytes_counts_each_storage_once():
    m = torch.nn.Linear(10, 10)
    view = m.weight.detach()[:2]  # a view of the weight: no new storage
    assert held_bytes(m, [view]) == (100 + 10) * 4
    assert held_bytes(m, exclude=[m.weight]) == 10 * 4


@pytest.mark.parametrize(
    "task,outer",
    [
        ({"task": "digits"}, "diloco:inner_steps=4"),
        (
            {"task": "lm", "task.d_model": 32, "task.n_layers": 1, "task.n_heads": 2, "task.context": 32},
            "diloco:inner_steps=4",
        ),
        ({"task": "digits"}, "diloco:inner_steps=4,compressor=(topkq:ratio=0.01,bits=2)"),
    ],
)
def test_memory_prediction_within_ten_percent_of_the_held_peak(task, outer):
    torch.set_num_threads(1)
    base = {**task, "workers": 2, "islands": 2, "steps": 8, "progress": False, "eval_every": 0}
    plan_cfg = job_config(base)
    prof, model = profile_job(plan_cfg)
    pred = predict(candidate(outer, plan_cfg, model), prof, Topology(2, 2), parse_link("1gbit"), parse_link("1gbit"))
    measured = simulated_held_peak(from_mapping({**base, "outer": outer}), 8)
    assert len(measured) == 2
    for got in measured:
        assert pred.memory.total == pytest.approx(got, rel=0.10), (pred.memory, measured)
