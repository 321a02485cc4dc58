"""DDP's and ZeRO-1's predicted bytes against the ledger of a real 2-process gloo run."""

import json

import pytest

from islands.app.launch import launch
from islands.app.validate import validate
from islands.config import from_mapping
from islands.plan import Topology, parse_link, predict
from islands.plan.api import candidate, job_config, profile_job


@pytest.mark.parametrize("inner", ["ddp", "zero1"])
def test_flat_bytes_match_a_two_process_ledger(tmp_path, monkeypatch, inner):
    monkeypatch.setenv("ISLANDS_PLAN_CACHE", str(tmp_path / "cache"))
    base = {"task": "digits", "workers": 2, "steps": 12, "progress": False, "eval_every": 0}
    cfg = validate(from_mapping({**base, "inner": inner}))
    assert launch(cfg, tmp_path / "run") == 0
    ledger = json.loads((tmp_path / "run" / "run.json").read_text())["comm"]["per_rank"][0]
    plan_cfg = job_config(base)
    prof, model = profile_job(plan_cfg)
    pred = predict(candidate(inner, plan_cfg, model), prof, Topology(2, 1), parse_link("1gbit"), parse_link("1gbit"))
    assert pred.run_bytes(12) == ledger["total_sent"]
