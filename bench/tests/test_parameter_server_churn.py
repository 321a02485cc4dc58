"""The parameter-server experiment's churn bookkeeping for the ps arms (no job needed): the killer's round count
under ps (the victim's acknowledged step in the job's store, continued across restarts) beside the group's rounds
under DiLoCo, and the survivors' applied and refused pushes from their served_end events."""

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from islands_bench.experiments.parameter_server import (
    VICTIM,
    GroupRounds,
    ServedRounds,
    _backstop,
    run_churn,
    served_counts,
)


class Store:
    """The job store's read side, in a dict (the experiments lane runs bench/tests alone, without tests/harness)."""

    def __init__(self):
        self.kv: dict[str, bytes] = {}

    def check(self, keys) -> bool:
        return all(k in self.kv for k in keys)

    def get(self, key: str) -> bytes:
        return self.kv[key]


def test_ps_rounds_are_the_victims_acknowledged_step_over_h_and_group_rounds_the_join_keys():
    store, served, group = Store(), ServedRounds(20), GroupRounds()
    assert served(store) == 0 and group(store) == 0
    store.kv[f"ps/clock/{VICTIM}"] = json.dumps({"step": 60, "island": 5, "pushes": 3}).encode()
    store.kv["ps/clock/0"] = json.dumps({"step": 400, "island": 0, "pushes": 20}).encode()  # another island's
    assert served(store) == 3
    store.kv.update({"round/1/join": b"[]", "round/2/join": b"[]"})
    assert group(store) == 2
    store.kv["round/3/join"] = b"[]"
    assert group(store) == 3


def test_served_counts_sum_the_survivors_served_end_events(tmp_path):
    elastic = tmp_path / "elastic"
    elastic.mkdir()
    for name, pushes, refused in (("w0", 20, 0), ("w2.3", 4, 1)):
        events = [{"type": "entered", "via": "service"}, {"type": "served_end", "pushes": pushes, "refused": refused}]
        (elastic / f"{name}.json").write_text(json.dumps({"final": {"events": events}}))
    (elastic / "restarts.json").write_text(json.dumps({"max_restarts": 3, "restarts": []}))
    assert served_counts(tmp_path) == (24, 1)


def test_a_frozen_victim_that_nobody_kills_is_killed_by_the_backstop():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        _backstop(proc, 0.3, threading.Event())
        assert proc.wait(timeout=5) == -signal.SIGKILL
        assert 0.3 <= time.monotonic() - t0 < 5
    finally:
        proc.kill()


def test_the_backstop_leaves_a_victim_the_launcher_already_killed():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc.send_signal(signal.SIGSTOP)
    threading.Timer(0.1, proc.kill).start()  # the launcher's kill, after its heartbeat timeout
    t0 = time.monotonic()
    _backstop(proc, 30.0, threading.Event())
    assert time.monotonic() - t0 < 5  # returned on the launcher's kill, not after 30 s
    assert proc.wait(timeout=5) == -signal.SIGKILL


def test_an_unknown_fault_is_refused_by_name():
    with pytest.raises(ValueError, match="fault='pause': expected one of kill, freeze"):
        run_churn(None, {}, 0.1, 1, fault="pause")  # type: ignore[arg-type]
