"""chaos-torchft's harness without torchft: every event of the campaign is either applied to torchft's model or
named as not applicable with a reason, and the harness's launcher duties (restart a replica that died, kill and
restart one frozen past the lighthouse's heartbeat timeout, restart nothing once a replica finished)."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from islands.app.validate import validate
from islands.config import from_mapping
from islands_bench.experiments import chaos, chaos_torchft
from islands_bench.experiments.churn_torchft import TorchftSettings


def test_every_event_kind_is_applied_or_named_not_applicable():
    kinds = set(chaos.campaign(100, seed=0)) | set(chaos.KINDS) | set(chaos.HEALS.values())
    applied = {"kill-worker", "freeze-worker", "kill-coordinator"}
    assert kinds - applied == set(chaos_torchft.NOT_APPLICABLE)
    ev = chaos_torchft.Event("cut-link")
    chaos_torchft._apply(ev, job=None, rng=random.Random(0), log=print)  # touches no job
    assert not ev.applied and ev.note.startswith("not applicable: ")


class _Sleeper(chaos_torchft.Job):
    """A Job whose replicas are `sleep` processes (no torchft): its restart and watchdog logic alone."""

    def start(self, shard: int, first: bool):
        n = self.incarnation[shard]
        name = f"r{shard}" if n == 0 else f"r{shard}.{n}"
        self.live[name] = chaos_torchft.Replica(name, shard, subprocess.Popen(["sleep", "60"]))
        return self.live[name]


def _job(tmp_path: Path, max_restarts: int) -> _Sleeper:
    cfg = validate(
        from_mapping(
            dict(
                task="digits",
                workers=2,
                islands=2,
                outer="diloco:inner_steps=5",
                steps=10,
                progress=False,
                run_dir=str(tmp_path),
            )
        )
    )
    settings = TorchftSettings(heartbeat_timeout_ms=200)
    return _Sleeper(cfg, tmp_path, 2, 2, lighthouse=None, settings=settings, max_restarts=max_restarts)


@pytest.mark.integration  # the harness's replicas are processes
def test_the_harness_restarts_a_killed_replica_and_a_frozen_one_after_the_heartbeat_timeout(tmp_path):
    job = _job(tmp_path, max_restarts=5)
    try:
        for shard in (0, 1):
            job.start(shard, first=True)
        job.live["r0"].proc.kill()
        frozen = job.live["r1"]
        frozen.proc.send_signal(signal.SIGSTOP)
        frozen.frozen_at = time.time()
        job.live["r0"].proc.wait()
        job.tick(log=lambda line: None)
        assert sorted(job.live) == ["r0.1", "r1"]  # the dead one at once; the frozen one not yet
        time.sleep(0.3)  # past the lighthouse's heartbeat timeout
        job.tick(log=lambda line: None)
        frozen.proc.wait(timeout=10)
        job.tick(log=lambda line: None)
        assert sorted(job.live) == ["r0.1", "r1.1"] and job.restarts == 2
        assert job.ended == {"r0": -signal.SIGKILL, "r1": -signal.SIGKILL}
    finally:
        job.stop()


@pytest.mark.integration  # the harness's replicas are processes
def test_once_a_replica_finished_a_failed_one_is_not_restarted(tmp_path):
    job = _job(tmp_path, max_restarts=5)
    try:
        job.live["r0"] = chaos_torchft.Replica("r0", 0, subprocess.Popen([sys.executable, "-c", "pass"]))
        job.live["r0"].proc.wait()
        job.start(1, first=True)
        job.tick(log=lambda line: None)
        job.live["r1"].proc.kill()
        job.live["r1"].proc.wait()
        job.tick(log=lambda line: None)
        assert not job.live and job.restarts == 0 and job.finished()
    finally:
        job.stop()
