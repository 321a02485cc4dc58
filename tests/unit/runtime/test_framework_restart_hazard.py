"""A framework's own default group in an island torch elastic may restart with several workers, sharing the agent's
store (docs/frameworks.md, "With accelerate launch" and after): its restarted group can meet in the dead attempt's
keys and fail or hang (the Hugging Face Trainer, 2 workers, torchrun --max-restarts 1: 2 of 3 restarts did in
session 40, none of 4 with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1). join_islands cannot re-form a group it did not
make, so it says what to set; where the launch is safe it says nothing."""

from __future__ import annotations

import warnings

import pytest
import torch.distributed as dist

from islands.runtime import world as world_mod
from islands.runtime.cross import CrossSpec

SHARED = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "1"}


@pytest.mark.parametrize(
    ("env", "workers", "warned"),
    [
        (SHARED, 2, True),
        (SHARED, 1, False),  # one worker: no peer's stale address to read
        ({**SHARED, "TORCHELASTIC_USE_AGENT_STORE": "False"}, 2, False),  # the variable set: a store per attempt
        ({**SHARED, "TORCHELASTIC_MAX_RESTARTS": "0"}, 2, False),  # no restarts
        ({}, 4, False),  # not under torch elastic
    ],
)
def test_the_hazard_is_named_only_where_a_restart_can_meet_stale_keys(env, workers, warned):
    line = world_mod.framework_group_restart_hazard(env, workers)
    assert (line is not None) == warned
    if warned:
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line and f"{workers} workers" in line


def test_join_islands_warns_over_a_framework_group_under_a_shared_store(monkeypatch):
    """The check runs where islands finds a group it did not make; the join itself is stubbed past that point."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    for key, value in SHARED.items():
        monkeypatch.setenv(key, value)

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    monkeypatch.setattr(world_mod, "_hand_off_at_exit", stop)
    with warnings.catch_warnings(record=True) as seen, pytest.raises(Stop):
        warnings.simplefilter("always")
        world_mod.join_islands(CrossSpec("127.0.0.1:1", islands=2, index=0))
    assert [str(w.message) for w in seen if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in str(w.message)]
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    with warnings.catch_warnings(record=True) as seen, pytest.raises(Stop):
        warnings.simplefilter("always")
        world_mod.join_islands(CrossSpec("127.0.0.1:1", islands=2, index=0))
    assert not [w for w in seen if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in str(w.message)]
