"""`islands train --outer ps:...,servers=1` end to end (issue #36): the CLI's multi-process job with the parameter
server as processes of its own (a supervisor and one shard server, each a fresh interpreter: the process path the
fault tests drive piece by piece). Every rank pushes and pulls (compressed) through them, the run record counts the
pushes as bytes across islands and holds the server process's own report, and nothing of the service is left
running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from harness.cli import TINY_FLAGS, islands_cli
from islands.sync.outer.ps_remote import REPLY_BYTES, REQUEST_BYTES


def _service_processes() -> set[int]:
    """Processes of a parameter service started in a fresh temporary directory (ServerProcesses' default)."""
    out = set()
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"islands.sync.outer.ps_process" in cmdline and b"islands-ps-" in cmdline:
            out.add(int(proc.name))
    return out


def test_a_job_trains_through_server_processes_counts_their_bytes_across_and_leaves_none(tmp_path, monkeypatch):
    """... with compressed pulls (`pulls=(int8)`, ps_pulls): each island's first pull is the fp32 model, every push's
    answer an int8 step from the copy the server holds for it, the final answers the model again."""
    monkeypatch.chdir(tmp_path)
    before = _service_processes()
    argv = ["train", *TINY_FLAGS, "--workers", "2", "--islands", "2", "--steps", "12", "--run-dir", "run"]
    assert islands_cli(*argv, "--outer", "ps:inner_steps=4,servers=1,pulls=(int8)") == 0
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["summary"]["strategy"] == "ddp+ps" and record["summary"]["steps"] == 12
    ranks = record["comm"]["per_rank"]
    for rank in ranks:  # each island (one worker each) pushed its rounds and pulled the model back each time
        assert rank["calls"]["ps_push"] >= 2 and rank["calls"]["ps_pull"] == rank["calls"]["ps_push"]
        assert rank["received"]["ps_pull"] > 0 and rank["sent"]["ps_push"] > 0
    pushed = sum(rank["sent"]["ps_push"] for rank in ranks) / len(ranks)
    # what went to the server left the island: counted across (it read 0.00 MB before ps_* kinds counted)
    assert record["summary"]["cross_island_mb_per_worker"] * 1e6 >= pushed
    # the server process's own report (ps_report.py), collected by the supervisor as it left: every push the islands
    # made applied (their pushes' payload bytes: requests' headers off, then one fp32 model each; 3 rounds each),
    # measured in the server process, nothing restarted
    report = record["parameter_server"]
    assert report["mode"] == "processes" and report["complete"] and report["missing"] is None
    (server,) = report["servers"]
    payload = sum(rank["sent"]["ps_push"] - rank["calls"]["ps_push"] * REQUEST_BYTES for rank in ranks)
    made = payload / (4 * server["parameters"][1])
    assert server["pushes_received"] == server["pushes_applied"] == made == 2 * 12 // 4
    assert server["pushes_refused"] == 0 and server["windows_stepped"] == 6 and server["goodput"] == 1.0
    assert (
        server["cpu_seconds"] > server["startup_cpu_seconds"] > 0
        and server["peak_memory_bytes"] >= server["startup_max_rss_bytes"] > 10e6
    )
    assert server["restarts"] == report["restarts"] == 0 and [p["final"] for p in server["processes"]] == [True]
    numel = server["parameters"][1]
    # the pulls: 2 first pulls whole, 3 pushes each answered with a step; DONE's answers whole and not counted; no
    # copy kept at the end, two (one per island) at most
    assert server["pulls"] == {"whole": 2, "coded": 6, "copies": 0, "peak_bytes": 2 * 4 * numel}
    # island 1 (island 0 also takes the servers' state for the final checkpoint, SNAPSHOT, counted as a pull): its
    # first pull and the DONE answers that carry a model (the first, and the final one when that came later) are the
    # fp32 model; its 3 pushes' answers int8 steps (the codes, one scale, 2 counts); then every reply's header
    rank = ranks[1]
    fp32 = rank["received"]["ps_pull"] - rank["calls"]["ps_pull"] * REPLY_BYTES - 3 * (numel + 4 + 16)
    assert fp32 in (2 * 4 * numel, 3 * 4 * numel), rank
    deadline = time.monotonic() + 30
    while _service_processes() - before:  # the supervisor and its shard end with the job
        assert time.monotonic() < deadline, _service_processes() - before
        time.sleep(0.1)


def test_a_job_trains_through_servers_on_a_host_of_their_own(tmp_path, monkeypatch):
    """`islands ps-host` as a process of its own (the island-free machine), and a job naming it with at=: island 0
    sends the sealed configuration there, every island pushes and pulls there, the report comes back to run.json and
    the host ends with the job, its journal in its own directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ISLANDS_TOKEN", "ps-host-test")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    host = subprocess.Popen(
        [sys.executable, "-m", "islands", "ps-host", "--dir", str(tmp_path / "host"), "--wait", "120"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert host.stdout is not None
        first = host.stdout.readline()  # "islands ps-host: listening on 127.0.0.1:PORT; waiting for a job"
        address = first.split("listening on ", 1)[1].split(";")[0]
        argv = ["train", *TINY_FLAGS, "--workers", "2", "--islands", "2", "--steps", "12", "--run-dir", "run"]
        assert islands_cli(*argv, "--outer", f"ps:inner_steps=4,servers=1,timeout=60,at='{address}'") == 0
        assert host.wait(60) == 0
        said = host.stdout.read()
    finally:
        if host.poll() is None:
            host.kill()
    assert "serving a job of 2 island(s): 1 server(s)" in said and "the job ended (done)" in said
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    report = record["parameter_server"]
    assert report["mode"] == "processes" and report["complete"] and report["stop"] == "done"
    assert report["servers"][0]["pushes_applied"] == 2 * 12 // 4 and report["servers"][0]["goodput"] == 1.0
    for rank in record["comm"]["per_rank"]:
        assert rank["calls"]["ps_push"] >= 2 and rank["received"]["ps_pull"] > 0
    assert (tmp_path / "host" / "shard0").is_dir() and (tmp_path / "host" / "config.pt").stat().st_mode & 0o077 == 0


def test_a_job_with_checkpoints_saves_the_servers_final_state_and_a_resume_continues_from_it(tmp_path, monkeypatch):
    # the final checkpoint is saved after the strategy's finish, when the servers have stopped: it failed with
    # ServiceGone (session 39, the parameter-server bench's link20 arm with servers=1) until island 0 took their
    # state before stopping them
    monkeypatch.chdir(tmp_path)
    common = ["train", *TINY_FLAGS, "--workers", "2", "--islands", "2", "--outer", "ps:inner_steps=4,servers=1"]
    first = [*common, "--steps", "12", "--run-dir", "run", "--checkpoint.every", "8"]
    assert islands_cli(*first) == 0
    (server,) = json.loads((tmp_path / "run" / "run.json").read_text())["parameter_server"]["servers"]
    assert server["pushes_applied"] == 6  # 2 islands x 3 rounds
    again = [*common, "--steps", "16", "--run-dir", "run2", "--checkpoint.resume", "run"]
    assert islands_cli(*again) == 0
    record = json.loads((tmp_path / "run2" / "run.json").read_text())
    assert record["summary"]["steps"] == 16
    (server,) = record["parameter_server"]["servers"]
    # the servers went on from the final checkpoint's state: its 6 pushes, then one more round of each island
    assert server["pushes_applied"] == 8
