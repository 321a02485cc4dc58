"""Ending a running elastic job at a requested step (islands.runtime.launch.stop, `islands stop`): every worker, leader
and follower, ends at that step with the final synchronisation, and they agree bitwise."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading

import pytest

import harness.elastic as elastic_jobs
from harness.cli import islands_cli
from harness.dict_store import DictStore
from islands.app.launch import launch_elastic
from islands.app.validate import validate
from islands.config import from_mapping
from islands.runtime.launch.stop import POLL_S, STOP_KEY, StopAt, request_stop, requested_stop


class FakeTrainer:
    def __init__(self, step: int, total: int):
        self.step, self.total_steps = step, total


def test_a_request_ahead_lowers_the_target_and_one_behind_or_beyond_changes_nothing():
    store, out = DictStore(), io.StringIO()
    stop = StopAt(store, "w0", poll_s=0.0, out=out)
    trainer = FakeTrainer(step=10, total=100)
    stop.on_step_end(trainer, 0.0)
    assert trainer.total_steps == 100 and requested_stop(store) is None  # no request
    request_stop(store, 500)
    stop.on_step_end(trainer, 0.0)
    assert trainer.total_steps == 100  # beyond the configured end: nothing to do
    request_stop(store, 5)
    stop.on_step_end(trainer, 0.0)
    assert trainer.total_steps == 100 and "at step 10 already" in out.getvalue()  # too late: refused, said once
    stop.on_step_end(trainer, 0.0)
    assert out.getvalue().count("already") == 1
    request_stop(store, 40)
    stop.on_step_end(trainer, 0.0)
    assert trainer.total_steps == 40 and "ending at step 40" in out.getvalue()
    trainer.step = 40
    request_stop(store, 40)  # the trainer then ends: the loop runs while step < total_steps
    stop.on_step_end(trainer, 0.0)
    assert trainer.total_steps == 40


def test_the_key_is_read_at_most_every_poll_interval():
    class Counting(DictStore):
        reads = 0

        def check(self, keys):
            self.reads += 1
            return super().check(keys)

    store = Counting()
    stop = StopAt(store, "w0")
    trainer = FakeTrainer(step=1, total=100)
    for _ in range(50):
        stop.on_step_end(trainer, 0.0)
    assert store.reads == 1 and POLL_S > 0


@pytest.mark.parametrize("bad", [0, -3, 2.5, "10", True])
def test_a_step_that_is_not_a_whole_number_above_zero_is_refused(bad):
    with pytest.raises(ValueError, match="whole number >= 1"):
        request_stop(DictStore(), bad)


def test_a_garbled_value_is_no_request():
    store = DictStore()
    store.set(STOP_KEY, "soon")
    assert requested_stop(store) is None


@pytest.mark.slow  # an elastic job of 2 islands x 2 workers, ended early: ~30 s on an idle 2-core machine
def test_islands_stop_ends_every_worker_of_a_running_job_at_the_step_and_they_agree(tmp_path):
    from islands.runtime.elastic.membership import REFUSED_EXIT_CODE

    run = tmp_path / "run"
    task, hold = elastic_jobs.gated_digits(tmp_path)
    cfg = validate(
        from_mapping(
            {
                **dict(
                    task=task,
                    workers=4,
                    islands=2,
                    outer="diloco:inner_steps=5",
                    elastic=True,
                    steps=2000,
                    global_batch=32,
                    eval_every=0,
                    warmup=2,
                    probe=False,
                    progress=False,
                    timeout=30.0,
                    heartbeat_timeout=10.0,
                    run_dir=str(run),
                ),
                "task.options.hold": str(hold),
            }
        )
    )
    hold.write_text("")  # the workers wait in their first forward until the requests are in (validate's does not)
    out, said, threads = io.StringIO(), [], []

    def stop(address: str, *token: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "islands", "stop", address, "--at-step", "42", *token],
            env=elastic_jobs.env(),
            capture_output=True,
            text=True,
            timeout=120,
        )

    def started(address, workers, coordinator):
        def requests():
            try:
                said.append(stop(address, "--token", "not-the-token"))
                said.append(stop(address, "--token-file", str(run / "token")))
            finally:
                hold.unlink()

        threads.append(threading.Thread(target=requests, daemon=True))
        threads[0].start()

    code = launch_elastic(cfg, run, out=out, on_started=started)
    threads[0].join(timeout=60)
    wrong, right = said
    assert wrong.returncode == REFUSED_EXIT_CODE and "refused" in wrong.stdout, wrong
    assert right.returncode == 0 and "end at step 42" in right.stdout, right
    assert code == 0, out.getvalue()
    recs = elastic_jobs.records(run)
    assert set(recs) == {"i0w0", "i0w1", "i1w0", "i1w1"}
    assert len({r["global_sha256"] for r in recs.values()}) == 1  # leaders and followers: one global model
    record = json.loads((run / "run.json").read_text())
    assert record["summary"]["steps"] == 42 and record["summary"]["islands"] == 2, record["summary"]
    logs = "".join(p.read_text() for p in (run / "logs").glob("*.log"))
    assert logs.count("ending at step 42 (a stop was requested)") == 4, logs


def test_islands_stop_refuses_a_step_below_one_before_reaching_for_the_job(capfd):
    code = islands_cli("stop", "127.0.0.1:1", "--at-step", "0", "--token", "x")  # the CLI in this process
    out = capfd.readouterr()
    assert code == 2 and "--at-step must be >= 1" in out.err + out.out
