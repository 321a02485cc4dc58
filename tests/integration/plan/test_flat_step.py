"""plan.flat_step measures a flat strategy's step between two gloo processes beside the plain step. It needs
processes: DDP's and FSDP's work exists only in a process group of several ranks."""

import pytest

from islands.plan.api import Profiler, job_config
from islands.plan.flat_step import flat_step_extra


def test_an_fsdp_step_costs_more_than_the_plain_step():
    cfg = Profiler.of(job_config({"task": "digits", "workers": 2, "islands": 1})).cfg
    # measured here: ~18 ms (DDP's ~4 ms); 1 ms leaves room for a faster machine
    assert flat_step_extra(cfg, "fsdp") > 1e-3


def test_an_unknown_flat_strategy_is_named():
    cfg = Profiler.of(job_config({"task": "digits", "workers": 2, "islands": 1})).cfg
    with pytest.raises(ValueError, match="flat strategy 'pipeline': one of ddp, zero1, fsdp"):
        flat_step_extra(cfg, "pipeline")
