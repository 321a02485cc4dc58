"""`islands train --outer ps:...,servers=1` end to end (issue #36): the CLI's multi-process job with the parameter
server as processes of its own (a supervisor and one shard server, each a fresh interpreter: the process path the
fault tests drive piece by piece). Every rank pushes and pulls through them, the run record counts the pushes as
bytes across islands, and nothing of the service is left running."""

from __future__ import annotations

import json
import time
from pathlib import Path

from harness.cli import TINY_FLAGS, islands_cli


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
    monkeypatch.chdir(tmp_path)
    before = _service_processes()
    argv = ["train", *TINY_FLAGS, "--workers", "2", "--islands", "2", "--steps", "12", "--run-dir", "run"]
    assert islands_cli(*argv, "--outer", "ps:inner_steps=4,servers=1") == 0
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["summary"]["strategy"] == "ddp+ps" and record["summary"]["steps"] == 12
    ranks = record["comm"]["per_rank"]
    for rank in ranks:  # each island (one worker each) pushed its rounds and pulled the model back each time
        assert rank["calls"]["ps_push"] >= 2 and rank["calls"]["ps_pull"] == rank["calls"]["ps_push"]
        assert rank["received"]["ps_pull"] > rank["sent"]["ps_push"] > 0
    pushed = sum(rank["sent"]["ps_push"] for rank in ranks) / len(ranks)
    # what went to the server left the island: counted across (it read 0.00 MB before ps_* kinds counted)
    assert record["summary"]["cross_island_mb_per_worker"] * 1e6 >= pushed
    deadline = time.monotonic() + 30
    while _service_processes() - before:  # the supervisor and its shard end with the job
        assert time.monotonic() < deadline, _service_processes() - before
        time.sleep(0.1)
