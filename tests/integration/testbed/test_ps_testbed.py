"""The parameter server's processes on a testbed (issue #36, servers on another host than the islands'): island 0
runs inside host 0 and starts the supervisor there, island 1 inside host 1 reaches it over the shaped link. The
supervisor tells the islands the address of the host's gloo interface (ps_service.advertised_host), not 127.0.0.1,
which host 1 cannot reach (before: island 1's store client timed out connecting to 127.0.0.1 and the job hung)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from harness.cli import TINY_FLAGS, islands_cli
from islands import testbed

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
        reason="the testbed needs root and iproute2 (ip, tc); CI runs as root",
    ),
    pytest.mark.slow,
]


def test_an_island_on_another_host_trains_through_the_server_processes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = "ps" + str(os.getpid() % 10000)
    testbed.up(name, hosts=2, rate="100mbit")
    try:
        argv = ["train", *TINY_FLAGS, "--workers", "2", "--islands", "2", "--steps", "8", "--run-dir", "run"]
        assert islands_cli(*argv, "--testbed", name, "--outer", "ps:inner_steps=4,servers=1,timeout=60") == 0
        record = json.loads((tmp_path / "run" / "run.json").read_text())
        ranks = record["comm"]["per_rank"]
        for rank in ranks:  # requests (the first pull, 2 rounds' pushes, DONE) each answered with the model
            assert rank["calls"]["ps_push"] == rank["calls"]["ps_pull"] >= 2 and rank["received"]["ps_pull"] > 0
        report = record["parameter_server"]
        assert report["complete"] and report["servers"][0]["pushes_applied"] == 4
        wire = {w["host"]: w for w in record["interconnect"]["wire_bytes_per_host"]}
        # island 1's pushes and pulls crossed the link to host 0, where the server runs
        assert wire[1]["tx"] >= ranks[1]["sent"]["ps_push"] and wire[1]["rx"] >= ranks[1]["received"]["ps_pull"]
    finally:
        testbed.down(name)


def test_servers_on_a_host_with_no_island_serve_both_islands_over_their_links(tmp_path, monkeypatch):
    """A 3-host testbed: the islands on hosts 0 and 1, `islands ps-host` on host 2 (the spare machine, as BytePS
    uses one). Island 0 is no longer next to its server: its pushes cross its own link too, and host 2's link
    carries both islands' pushes in and their pulls out."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ISLANDS_TOKEN", "ps-host-testbed")
    name = "pz" + str(os.getpid() % 10000)
    tb = testbed.up(name, hosts=3, rate="100mbit")
    host = None
    try:
        env = dict(os.environ, **tb.env(2), PYTHONUNBUFFERED="1")
        argv = [sys.executable, "-m", "islands", "ps-host", "--port", "29640", "--wait", "120"]
        host = subprocess.Popen(tb.wrap(2, argv), env=env, stdout=subprocess.PIPE, text=True)
        assert host.stdout is not None
        first = host.stdout.readline()
        assert f"listening on {tb.host(2).ip}:29640" in first, first  # its own address on the testbed
        train = ["train", *TINY_FLAGS, "--workers", "2", "--islands", "2", "--steps", "8", "--run-dir", "run"]
        spec = f"ps:inner_steps=4,servers=1,timeout=60,at='{tb.host(2).ip}:29640'"
        assert islands_cli(*train, "--testbed", name, "--outer", spec) == 0
        assert host.wait(60) == 0
        record = json.loads((tmp_path / "run" / "run.json").read_text())
        ranks = record["comm"]["per_rank"]
        report = record["parameter_server"]
        assert report["complete"] and report["servers"][0]["pushes_applied"] == 4
        wire = {w["host"]: w for w in record["interconnect"]["wire_bytes_per_host"]}
        for k in (0, 1):  # each island's pushes left its host and its pulls came in
            assert wire[k]["tx"] >= ranks[k]["sent"]["ps_push"] and wire[k]["rx"] >= ranks[k]["received"]["ps_pull"]
        pushed = sum(rank["sent"]["ps_push"] for rank in ranks)
        pulled = sum(rank["received"]["ps_pull"] for rank in ranks)
        assert wire[2]["rx"] >= pushed and wire[2]["tx"] >= pulled  # all of it through the server host's link
    finally:
        if host is not None and host.poll() is None:
            host.kill()
        testbed.down(name)
