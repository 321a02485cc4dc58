"""The byte formulas against the ledger of real (simulated) runs: DiLoCo, streaming DiLoCo and a compressed exchange,
at run lengths that do and do not end on a round."""

import json

import pytest

from islands.app.launch import launch_simulated
from islands.config import from_mapping
from islands.plan import Topology, parse_link, predict
from islands.plan.api import candidate, job_config, profile_job


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ISLANDS_PLAN_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize(
    "outer,steps",
    [
        ("diloco:inner_steps=5", 20),  # ends on a round: no final synchronisation
        ("diloco:inner_steps=6", 20),  # does not: one more exchange at finish
        ("streaming-diloco:inner_steps=8", 20),  # 4 fragments, tau=1, 4-bit payloads, final sync of every fragment
        ("diloco:inner_steps=5,compressor=(topkq:ratio=0.01,bits=2)", 17),
    ],
)
def test_outer_bytes_match_the_ledger(tmp_path, outer, steps):
    base = {"task": "digits", "workers": 2, "islands": 2, "steps": steps, "progress": False, "eval_every": 0}
    cfg = from_mapping({**base, "outer": outer, "simulate": True})
    assert launch_simulated(cfg, tmp_path / "run") == 0
    ledger = json.loads((tmp_path / "run" / "run.json").read_text())["comm"]["per_rank"][0]
    plan_cfg = job_config(base)
    prof, model = profile_job(plan_cfg)
    pred = predict(candidate(outer, plan_cfg, model), prof, Topology(2, 2), parse_link("1gbit"), parse_link("1gbit"))
    assert pred.bytes_exact
    assert pred.run_bytes(steps) == ledger["total_sent"]
