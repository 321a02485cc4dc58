"""No process of a job can hang its launcher, and no launch races (issue #33 item 9).

The fork server (islands.runtime.launch.spawn) stopped with SIGSTOP or killed: the launcher still learns how each worker
ended, a start request to a stopped server does not hang, and an elastic job whose workers finished is reported
finished, also after the server is thawed. The rendezvous port of `islands run` belongs to the launcher from the
moment it is chosen: another process cannot take it before rank 0 uses it. (A frozen or killed worker is
tests/integration/elastic/test_failure_detection.py's and tests/integration/runtime/test_launch.py's; a killed
launcher, tests/integration/membership/test_no_spof.py's.)"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import forkserver
from pathlib import Path

import pytest

from harness.elastic import elastic_config
from islands.app.launch import launch_elastic
from islands.runtime.launch import spawn
from islands.runtime.launch.ranks import Placement, port_is_free

HEARTBEAT = 3.0  # seconds: the elastic jobs' heartbeat timeout
SPAWN = [sys.executable, "-m", "islands.runtime.launch.spawn"]


def _server() -> int | None:
    return forkserver._forkserver._forkserver_pid


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return None


def _thaw_or_kill(pid: int | None, kill: bool = False) -> None:
    if pid is None:
        return
    for sig in (signal.SIGCONT,) + ((signal.SIGKILL,) if kill else ()):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _forked(tmp_path: Path, name: str, sleep: float, code: int):
    env = dict(os.environ, SPAWN_SLEEP=str(sleep), SPAWN_EXIT=str(code))
    with open(tmp_path / f"{name}.log", "w") as log:
        proc = spawn.start(SPAWN, env, stdout=log, stderr=subprocess.STDOUT)
    assert isinstance(proc, spawn.ForkedProcess)
    return proc


def _bounded(fn, timeout: float):
    """Run fn() in a thread; (finished in time, its result or exception)."""
    box: dict = {}

    def body():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e
        box["ended"] = time.monotonic()

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout)
    return (not t.is_alive()), box, t


@pytest.mark.slow
def test_a_stopped_fork_server_does_not_hide_its_workers_exits(tmp_path):
    done = _forked(tmp_path, "ok", 1.0, 0)
    failed = _forked(tmp_path, "bad", 1.0, 3)
    server = _server()
    os.kill(server, signal.SIGSTOP)
    try:
        # the server cannot reap them (they stay zombies under it); the launcher still learns their codes
        assert done.wait(timeout=20) == 0
        assert failed.wait(timeout=20) == 3
    finally:
        _thaw_or_kill(server)
    time.sleep(0.5)  # the thawed server now reaps them and sends their codes: nothing changes
    assert (done.poll(), failed.poll()) == (0, 3)


@pytest.mark.slow
def test_a_killed_fork_server_neither_fakes_nor_hides_its_workers_exits(tmp_path):
    running = _forked(tmp_path, "running", 3.0, 3)
    victim = _forked(tmp_path, "victim", 60.0, 0)
    server = _server()
    os.kill(server, signal.SIGKILL)
    time.sleep(0.5)
    assert running.poll() is None and victim.poll() is None  # still running, not "exit 255"
    assert running.wait(timeout=20) == 3  # its own report (nobody else can tell it now)
    os.kill(victim.pid, signal.SIGKILL)
    # exact while it is a zombie nobody reaped yet; once reaped by init, an exit said to be of unknown status
    code = victim.wait(timeout=20)  # never a wait without end
    assert code == -signal.SIGKILL or (code == spawn.UNKNOWN_EXIT and "unknown" in victim.note), (code, victim.note)
    # the next start gets a new server
    again = _forked(tmp_path, "again", 0.0, 0)
    assert again.wait(timeout=120) == 0 and _server() != server


@pytest.mark.slow
def test_a_start_request_to_a_stopped_fork_server_does_not_hang(tmp_path):
    _forked(tmp_path, "warm", 0.0, 0).wait(timeout=120)  # the server is up (its first start imports torch)
    server = _server()
    os.kill(server, signal.SIGSTOP)
    try:
        ok, box, _ = _bounded(lambda: _forked_or_fresh(tmp_path), 30)
        assert ok, "starting a worker waited on the stopped fork server"
        assert "error" not in box, box.get("error")
        assert box["value"].wait(timeout=120) == 0  # started anyway (as a fresh interpreter)
        assert json.loads((tmp_path / "fresh.log").read_text().splitlines()[0])["argv"] == []
    finally:
        _thaw_or_kill(server, kill=True)
    time.sleep(1.0)
    # the request the stopped server held never runs late: only the fresh interpreter wrote its line
    assert len((tmp_path / "fresh.log").read_text().splitlines()) == 1


def _forked_or_fresh(tmp_path: Path):
    with open(tmp_path / "fresh.log", "w") as log:
        return spawn.start(SPAWN, dict(os.environ), stdout=log, stderr=subprocess.STDOUT)


def _elastic_cfg(run: Path):
    return elastic_config(
        workers=2,
        islands=2,
        outer="diloco:inner_steps=4",
        steps=12,
        global_batch=16,
        heartbeat_timeout=HEARTBEAT,
        run_dir=str(run),
    )


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL])
def test_an_elastic_job_whose_fork_server_is_stopped_or_killed_ends_finished(tmp_path, sig):
    run = tmp_path / "run"
    hit: list = []

    def on_started(address, workers, coordinator):
        hit.append(_server())
        os.kill(hit[0], sig)  # right after its workers started: they train and finish under a stopped/dead server

    out = io.StringIO()
    ok, box, thread = _bounded(lambda: launch_elastic(_elastic_cfg(run), run, out=out, on_started=on_started), 240)
    try:
        assert ok, f"the launcher still waits after its workers finished:\n{out.getvalue()}"
        assert "error" not in box, box.get("error")
        assert box["value"] == 0, out.getvalue()  # finished, not "every worker failed"
        assert json.loads((run / "run.json").read_text())["summary"]["steps"] == 12
        assert "every worker failed" not in out.getvalue()
    finally:
        _thaw_or_kill(hit[0] if hit else None, kill=True)  # thawed afterwards: the job stays finished
        thread.join(60)
    time.sleep(0.5)
    assert box.get("value") == 0 and "every worker failed" not in out.getvalue()


# Rank 1 plays another job on the machine: before the rendezvous it tries to take the port rank 0 was handed
# (as a process that picked the same free port would); rank 0 rendezvouses once rank 1 has tried.
STEALING = """
import os, socket, sys, time
from pathlib import Path
import torch.distributed as dist

out = Path(sys.argv[1])
if os.environ["RANK"] == "1":
    thief = socket.socket()
    try:
        thief.bind((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
        thief.listen()
        took = True
    except OSError:
        took = False
    (out / "thief").write_text(str(took))
else:
    while not (out / "thief").exists():
        time.sleep(0.05)
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
print("rendezvous done", flush=True)
"""


@pytest.mark.slow
def test_the_rendezvous_port_cannot_be_taken_between_its_choice_and_its_use(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(STEALING)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "islands",
            "run",
            "--workers",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
            str(script),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert (tmp_path / "thief").read_text() == "False", "another process could take the job's port"
    assert done.returncode == 0, done.stderr
    assert "rendezvous done" in done.stdout


def test_a_loopback_placement_holds_its_port_until_it_is_dropped():
    placement = Placement.loopback()
    assert not port_is_free(placement.port)  # bound and listening from the moment it was chosen
    assert placement.env(0)["MASTER_PORT"] == str(placement.port)
    port = placement.port
    del placement
    assert port_is_free(port)


@pytest.mark.slow
def test_a_stopped_job_host_ends_the_elastic_job_with_a_clear_error_within_the_heartbeat_timeout(tmp_path):
    run = tmp_path / "run"
    hosts: list = []
    when: dict = {}

    def on_started(address, workers, coordinator):
        hosts.append(coordinator.proc.pid)
        os.kill(hosts[0], signal.SIGSTOP)  # the job's store with it: no worker can join, beat or finish
        when["stopped"] = time.monotonic()

    out = io.StringIO()
    ok, box, thread = _bounded(lambda: launch_elastic(_elastic_cfg(run), run, out=out, on_started=on_started), 120)
    try:
        assert ok, f"the launcher waits on its stopped job host:\n{out.getvalue()}"
        assert box.get("value") == 1, (box, out.getvalue())  # an error, not an exception from a store call
        assert "job host" in out.getvalue() and "stopped" in out.getvalue(), out.getvalue()
        assert box["ended"] - when["stopped"] < HEARTBEAT + 2 * HEARTBEAT + 10  # detection, one store call, stop
    finally:
        _thaw_or_kill(hosts[0] if hosts else None, kill=True)
        thread.join(60)
