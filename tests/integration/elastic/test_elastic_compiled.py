"""`islands train --elastic --compile` (issue #34; docs/own-model.md, "Compiled models"): a job of 2 one-worker
islands (a BatchNorm CNN behind the gated digits task, DiLoCo across) whose model the workers compile after `wrap`
(aot_eager). Island 1 is SIGKILLed after two rounds, the launcher restarts it, the restarted worker (compiling its
own model afresh) is admitted at a round boundary with the members' global state under the eager names and ends on
the same global model as island 0, and run.json records the compile time. No worker hits torch's recompile limit
(which would run the model eagerly from then on)."""

from __future__ import annotations

import functools
import json
import os
import signal
import threading

import pytest

import harness.elastic as elastic_jobs
from harness.cli import islands_cli
from harness.flags import flags
from islands.runtime.elastic.membership import connect

STEPS = 30  # six rounds of 5: two before the kill, the join at a boundary after the restart, rounds after it


@pytest.mark.slow  # an elastic job of 2 one-worker islands, one restarted, compiling: ~20 s on 2 cores
def test_an_elastic_compiled_job_restarts_a_killed_island_and_records_its_compile_time(tmp_path, monkeypatch, capsys):
    import islands.app.launch as launch_module

    task, hold = elastic_jobs.gated_digits(tmp_path)
    config = tmp_path / "job.toml"  # the task's free options: a TOML table, as a user gives them
    config.write_text(f'[task.options]\nhold = "{hold}"\nmodel = "bn-cnn"\n')
    run_dir = tmp_path / "run"
    errors: list = []

    def fault(address, workers):
        try:
            host, port = address.split(":")
            store = connect(host, int(port))
            elastic_jobs.wait(lambda: store.check(["round/2/join"]), "two rounds")
            assert [w.name for w in workers] == ["w0", "w1"]
            hold.write_text("")  # island 0 goes on only once the restarted island is built
            os.kill(workers[1].proc.pid, signal.SIGKILL)
            elastic_jobs.wait(lambda: store.check(["ready/w1.1"]), "the restarted island to be built")
        except BaseException as e:  # noqa: BLE001 - surfaced after the job
            errors.append(e)
        finally:
            hold.unlink(missing_ok=True)  # never leave the job waiting

    def started(address, workers, coordinator):
        threading.Thread(target=fault, args=(address, workers), daemon=True).start()

    # the CLI's own path (islands.cli -> launch -> launch_elastic), with the fault injected where the job starts
    elastic = functools.partial(launch_module.launch_elastic, on_started=started)
    monkeypatch.setattr(launch_module, "launch_elastic", elastic)
    code = islands_cli(
        "train",
        *flags(config=config, task=task, workers=2, islands=2, outer="diloco:inner_steps=5", elastic=True),
        *flags(compile=True, compile_backend="aot_eager", max_restarts=1, heartbeat_timeout=5, timeout=30),
        *flags(steps=STEPS, global_batch=16, warmup=2, eval_every=0, no_probe=True, no_progress=True, run_dir=run_dir),
    )
    log = capsys.readouterr().err
    assert not errors, (errors, log)
    assert code == 0, log + elastic_jobs.logs(run_dir)
    assert "restarting island 1 (restart 1 of 1) as w1.1" in log, log
    recs = elastic_jobs.records(run_dir)
    assert set(recs) == {"w0", "w1.1"}, log
    assert recs["w0"]["global_sha256"] == recs["w1.1"]["global_sha256"]  # one global model, bit for bit
    join = next(e for e in recs["w0"]["final"]["events"] if e["type"] == "join")
    entered = next(e for e in recs["w1.1"]["final"]["events"] if e["type"] == "entered")
    assert join["joined"] == ["w1.1"] and entered["global_sha256"] == join["global_sha256"]
    run = json.loads((run_dir / "run.json").read_text())
    assert run["config"]["train"]["compile"] is True and run["summary"]["steps"] == STEPS
    part = run["compile"]
    assert part["backend"] == "aot_eager" and part["graphs"] >= 1  # compiled, not an eager fallback
    assert part["seconds"] == run["summary"]["compile_seconds"] >= 0
    assert part["seconds"] == pytest.approx(max(part["first_step_seconds"] - part["steady_step_seconds"], 0.0))
    # no worker recompiled its model round after round until torch gave up and ran it eagerly (the rounds'
    # buffer snapshots stay outside the graph; test_compile.py has the unit test)
    worker_logs = elastic_jobs.logs(run_dir)
    assert "recompile_limit" not in worker_logs and "w1.1" in worker_logs, worker_logs
