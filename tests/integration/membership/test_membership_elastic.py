"""Elastic jobs end to end (gloo, digits, local SGD): a SIGKILLed worker is dropped and survivors agree
bitwise; a wrong token is refused with a clear line; a joiner receives the global model and contributes."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import harness.elastic as elastic_jobs
from islands.app.launch import launch_elastic
from islands.app.validate import validate
from islands.config import from_mapping
from islands.runtime.elastic.membership import REFUSED_EXIT_CODE


def _cfg(tmp_path: Path, workers: int, steps: int, every: int, task: str = "digits"):
    return validate(
        from_mapping(
            dict(
                task=task,
                workers=workers,
                islands=workers,
                outer=f"local-sgd:every={every}",
                elastic=True,
                steps=steps,
                global_batch=8 * workers,
                eval_every=0,
                warmup=2,
                probe=False,
                progress=False,
                timeout=30.0,
                heartbeat_timeout=5.0,
                run_dir=str(tmp_path / "run"),
            )
        )
    )


def _wait(store, key: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not store.check([key]):
        assert time.monotonic() < deadline, f"timed out waiting for {key}"
        time.sleep(0.02)


def _run(cfg, tmp_path: Path, during) -> tuple[int, str]:
    """Launch the job in this process; `during(address, workers)` runs on a thread once workers start."""
    out = io.StringIO()
    errors: list[BaseException] = []

    threads = []

    def started(address, workers, coordinator):
        def body():
            try:
                during(address, workers)
            except BaseException as e:  # noqa: BLE001 - surfaced after the job ends
                errors.append(e)

        threads.append(threading.Thread(target=body, daemon=True))
        threads[0].start()

    code = launch_elastic(cfg, tmp_path / "run", out=out, on_started=started)
    threads[0].join(timeout=200)
    if errors:
        raise errors[0]
    return code, out.getvalue()


def test_sigkill_one_of_four_survivors_finish_and_agree_bitwise(tmp_path):
    cfg = _cfg(tmp_path, workers=4, steps=90, every=3)
    killed = {}

    def kill_mid_run(address, workers):
        _wait(elastic_jobs.store(address), "round/4/join")  # four rounds committed: training is well under way
        workers[2].proc.send_signal(signal.SIGKILL)
        killed["at"] = time.time()

    code, log = _run(cfg, tmp_path, kill_mid_run)
    assert code == 0, log
    assert "w2 left (killed by SIGKILL)" in log
    recs = elastic_jobs.records(tmp_path / "run")
    assert set(recs) == {"w0", "w1", "w3"}  # the killed worker wrote nothing; nobody restarted
    digests = {r["global_sha256"] for r in recs.values()}
    assert len(digests) == 1, "survivors disagree on the global parameters"
    for r in recs.values():
        assert sorted(m[1] for m in r["final"]["members"]) == ["w0", "w1", "w3"]
        failures = [e for e in r["final"]["events"] if e["type"] == "failure"]
        assert len(failures) == 1 and failures[0]["gone"] == ["w2"]
        assert failures[0]["stall_seconds"] < 10.0  # bounded by dead-flag detection, not the 30 s timeout
        sizes = [s["size"] for s in r["syncs"]]
        assert sizes[0] == 4 and sizes[-1] == 3
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["summary"]["steps"] == 90 and run["summary"]["workers"] == 3


def _join(address: str, token_args: list[str], name: str, run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "islands", "join", address, *token_args, "--name", name, "--run-dir", str(run_dir)],
        env=elastic_jobs.env(),
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow  # a job plus two `islands join` processes
def test_wrong_token_refused_and_joiner_gets_global_model_and_contributes(tmp_path):
    # the members are held at their first training step (the gated task) until the joiner, a fresh process
    # importing torch, is ready; then the boundary after round 1 admits it and everyone trains 48 steps
    task, hold = elastic_jobs.gated_digits(tmp_path)
    cfg = _cfg(tmp_path, workers=2, steps=48, every=4, task=task)
    cfg.task.options["hold"] = str(hold)
    cfg.checkpoint.every = 4  # asynchronous saves around the join: the members finish any in flight first
    hold.write_text("")
    seen = {}

    def joins(address, workers):
        try:
            bad = threading.Thread(
                target=lambda: seen.update(
                    bad=_join(address, ["--token", "not-the-token"], "intruder", tmp_path / "bad")
                )
            )
            bad.start()  # both start at once: the refusal need not delay the good joiner
            good = threading.Thread(
                target=lambda: seen.update(
                    good=_join(address, ["--token-file", str(tmp_path / "run" / "token")], "j1", tmp_path / "j1")
                )
            )
            good.start()
            _wait(elastic_jobs.store(address), "ready/j1", timeout=240)
        finally:
            hold.unlink(missing_ok=True)  # never leave the job waiting
        good.join(timeout=240)
        bad.join(timeout=240)

    code, log = _run(cfg, tmp_path, joins)
    assert code == 0, log
    bad = seen["bad"]
    token = (tmp_path / "run" / "token").read_text().strip()
    assert bad.returncode == REFUSED_EXIT_CODE
    assert "join refused" in bad.stdout + bad.stderr and "wrong token" in bad.stdout + bad.stderr
    assert "refused 'intruder'" in log and token not in log and token not in bad.stdout + bad.stderr
    good = seen["good"]
    assert good.returncode == 0, good.stdout + good.stderr
    members = elastic_jobs.records(tmp_path / "run")
    joiner = json.loads((tmp_path / "j1" / "elastic" / "j1.json").read_text())
    # the joiner received exactly the members' global model at its entry round
    entered = next(e for e in joiner["final"]["events"] if e["type"] == "entered")
    join_events = [next(e for e in r["final"]["events"] if e["type"] == "join") for r in members.values()]
    assert {e["global_sha256"] for e in join_events} == {entered["global_sha256"]}
    assert {e["round"] for e in join_events} == {entered["round"]}
    # it contributes from the next round on: every sync it made had all three members
    rounds = [s for s in joiner["syncs"] if s["kind"] == "outer_params"]
    assert rounds and all(s["size"] == 3 for s in rounds)
    first_member_round = [s for s in members["w0"]["syncs"] if s["kind"] == "outer_params" and s["size"] == 3]
    assert len(first_member_round) == len(rounds)  # the joiner was in every 3-member round, from the first
    # and at the end everyone agrees bit for bit
    assert len({r["global_sha256"] for r in members.values()} | {joiner["global_sha256"]}) == 1
    # the join abandoned no checkpoint, and the last one holds all three members' parts
    ckpt = json.loads((tmp_path / "run" / "run.json").read_text())["checkpoint"]
    assert ckpt["async"] is True and ckpt["abandoned_membership_change"] == [] and ckpt["saves"]["local"] == 12
    from islands.checkpoint import CheckpointStore

    store = CheckpointStore(tmp_path / "run" / "ckpt", clean=False)
    assert store.latest_step() == 48 and store.verify(48) == []
    assert store.load(48, rank=2).tree["world"]["size"] == 3


@pytest.mark.parametrize(
    "bad,needle",
    [
        (dict(outer=""), "needs an outer strategy"),
        (dict(islands=1, outer="local-sgd:every=2", inner="single"), "one worker per island"),
        (dict(outer="diloco:overlap=delayed"), "overlap=delayed"),  # overlap-local-sgd runs elastically (#20 item 4)
        (dict(heartbeat_timeout=0.0), "heartbeat_timeout"),
    ],
)
def test_elastic_config_rejects_unsupported_combinations(bad, needle):
    from islands.config import ConfigError

    values = dict(task="digits", workers=4, islands=4, outer="local-sgd:every=2", elastic=True, global_batch=32)
    values.update(bad)
    with pytest.raises(ConfigError, match=needle):
        validate(from_mapping(values))
