"""The launcher: a real job end to end, a SIGKILLed worker, a raising worker, a busy port."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.cli import islands_cli
from harness.flags import tiny
from islands.app.launch import launch
from islands.config import from_mapping
from islands.runtime.launch.ranks import LaunchError

ISLANDS = [sys.executable, "-m", "islands"]
TINY = tiny(eval_batches=2, threads=1)


def test_two_worker_job_writes_record_and_plot(tmp_path, capfd):
    # the CLI in this process (harness.cli): its launcher starts the workers as from a shell, and draws loss.png
    run = tmp_path / "run"
    code = islands_cli(
        "train", "--workers", "2", "--steps", "6", "--eval-every", "3", "--log-every", "2", "--run-dir", str(run), *TINY
    )
    out = capfd.readouterr()  # rank 0's stdout is the launcher's
    assert code == 0, out.err
    rec = json.loads((run / "run.json").read_text())
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (run / "loss.png").stat().st_size > 1000
    assert rec["world"]["size"] == 2 and rec["summary"]["steps"] == 6
    assert rec["interconnect"]["measured"] and rec["interconnect"]["p2p"]["bandwidth_gbit_s"] > 0
    assert "per worker" in rec["baseline"]["definition"]
    assert [v["step"] for v in rec["series"]["val"]] == [0, 3, 6]
    assert "git_revision" in rec["versions"] and rec["config"]["world"]["workers"] == 2
    # every rank handed the same bytes; equal to steps x fp32 gradient payload
    sent = {r["sent"]["grad_all_reduce"] for r in rec["comm"]["per_rank"]}
    assert len(sent) == 1 and sent.pop() % 6 == 0
    assert "islands run summary" in out.out


def _writing_to(log: Path) -> list[int]:
    """The processes whose stderr is `log` (a rank's; forked from the fork server, it is not the launcher's child)."""
    found = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and os.readlink(p / "fd" / "2") == str(log):
                found.append(int(p.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_sigkilled_worker_ends_job_nonzero_within_timeout(tmp_path):
    job = subprocess.Popen(
        [
            *ISLANDS,
            "train",
            "--workers",
            "2",
            "--steps",
            "100000",
            "--timeout",
            "20",
            "--eval-every",
            "0",
            "--run-dir",
            str(tmp_path / "run"),
            *TINY,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        log = tmp_path / "run" / "logs" / "rank1.log"
        live = tmp_path / "run" / "live" / "rank1.jsonl"
        while time.monotonic() < deadline:  # until training is under way on rank 1: its live stream has a step
            if live.exists() and '"kind": "metrics"' in live.read_text():
                break
            time.sleep(0.2)
        [victim] = _writing_to(log)
        t = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _, err = job.communicate(timeout=40)
        assert job.returncode != 0
        assert time.monotonic() - t < 20  # well inside the collective timeout
        assert "worker rank 1 failed (killed by SIGKILL)" in err
    finally:
        if job.poll() is None:
            job.kill()


def test_raising_worker_shows_its_error(tmp_path, capfd):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("x" * 40)  # too short for one validation window: every worker raises
    code = islands_cli(
        "train", "--workers", "2", "--steps", "3", "--data", str(corpus), "--run-dir", str(tmp_path / "run"), *TINY
    )
    err = capfd.readouterr().err
    assert code == 1, err
    assert "failed (exit code 1)" in err and "is shorter than one context" in err


def test_busy_port_is_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        cfg = from_mapping({"workers": 2, "port": s.getsockname()[1]})
        with pytest.raises(LaunchError, match="busy"):
            launch(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before anything was written or started


def test_a_testbed_that_does_not_exist_is_refused_before_any_worker_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("ISLANDS_TESTBED_DIR", str(tmp_path / "testbeds"))
    with pytest.raises(LaunchError, match=r"no testbed named 'nosuchbed'.*islands testbed up --name nosuchbed"):
        launch(from_mapping({"workers": 2, "testbed": "nosuchbed"}), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_train_with_an_unknown_testbed_exits_2_with_a_message(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("ISLANDS_TESTBED_DIR", str(tmp_path / "testbeds"))
    code = islands_cli(
        "train", "--workers", "2", "--steps", "1", "--testbed", "nosuchbed", "--run-dir", str(tmp_path / "run"), *TINY
    )
    err = capfd.readouterr().err
    assert code == 2, err
    assert "no testbed named 'nosuchbed'" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "logs").exists()
