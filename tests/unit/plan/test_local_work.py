"""The planner's measured local work of a flat strategy (Profiler.local_work): what two processes measured beyond the
plain step, less what the cost model already gives the strategy's collectives and synchronisation between 2 workers
on the loopback probe's link, never below 0; outer candidates untouched. The measurement itself starts processes:
tests/integration/plan/test_flat_step.py."""

import pytest

from islands.plan import api
from islands.plan.api import Profiler, candidate, job_config
from islands.plan.costs import exposed_seconds
from islands.plan.links import Link

LOOPBACK = Link(8e9, 50e-6, "test loopback")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ISLANDS_PLAN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(api, "probe_link", lambda: LOOPBACK)


def _setup(monkeypatch, extra: dict[str, float]):
    measured = []

    def fake(cfg, kind, threads=1):
        measured.append(kind)
        return extra[kind]

    monkeypatch.setattr(api, "flat_step_extra", fake)
    cfg = job_config({"task": "digits", "workers": 2, "islands": 1})
    profiler = Profiler.of(cfg)
    prof = profiler.step(steps=4)
    cands = [candidate(s, cfg, profiler.task.model) for s in ("ddp", "fsdp")]
    return profiler, prof, cands, measured


def test_local_work_is_the_measured_extra_less_the_modelled_collectives(monkeypatch):
    profiler, prof, cands, measured = _setup(monkeypatch, {"ddp": 0.020, "fsdp": 0.050})
    out = profiler.local_work(cands, prof)
    assert measured == ["ddp", "fsdp"]
    for c, got, extra in zip(cands, out, (0.020, 0.050)):
        assert got.local_s == pytest.approx(extra - exposed_seconds(c, prof, 2, LOOPBACK))
        assert 0 < got.local_s < extra


def test_local_work_is_never_negative_and_cached(monkeypatch):
    profiler, prof, cands, measured = _setup(monkeypatch, {"ddp": 0.0, "fsdp": 0.0})
    assert [c.local_s for c in profiler.local_work(cands, prof)] == [0.0, 0.0]
    profiler.local_work(cands, prof)  # the second plan of the same job reads the cache
    assert measured == ["ddp", "fsdp"]


def test_local_work_is_measured_on_the_cpu_only(monkeypatch):
    profiler, prof, cands, measured = _setup(monkeypatch, {"ddp": 0.02, "fsdp": 0.05})
    profiler.device = "cuda"
    assert [c.local_s for c in profiler.local_work(cands, prof)] == [None, None] and measured == []


def test_outer_candidates_have_no_flat_local_work(monkeypatch):
    profiler, prof, _, measured = _setup(monkeypatch, {})
    cfg = job_config({"task": "digits", "workers": 2, "islands": 2})
    outer = [candidate("diloco:inner_steps=10", cfg, profiler.task.model)]
    assert profiler.local_work(outer, prof) == outer and measured == []
