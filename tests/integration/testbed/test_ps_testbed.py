"""The parameter server's processes on a testbed (issue #36, servers on another host than the islands'): island 0
runs inside host 0 and starts the supervisor there, island 1 inside host 1 reaches it over the shaped link. The
supervisor tells the islands the address of the host's gloo interface (ps_service.advertised_host), not 127.0.0.1,
which host 1 cannot reach (before: island 1's store client timed out connecting to 127.0.0.1 and the job hung).
Then the servers on a host with no island (`islands ps-host` on host 2 of 3), and an elastic ps job across hosts
whose killed island restarts on its host and reaches the servers on island 0's over the link."""

import io
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest

from harness.cli import TINY_FLAGS, islands_cli
from harness.elastic import QUIET_ELASTIC, gated_digits, kill_served_island_at_its_gate, wait_for_acked_pushes
from islands import testbed
from islands.app.launch import launch_elastic
from islands.app.validate import validate
from islands.config import from_mapping
from islands.runtime.elastic.auth import ControlAuth
from islands.runtime.elastic.membership import JobSpec, authed, connect, parse_address
from islands.testbed import state

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


def test_an_elastic_ps_job_across_hosts_restarts_a_killed_island_through_the_link(tmp_path, monkeypatch):
    """`islands train --elastic --testbed` with the server as processes: the first epoch's rank 0 (island 0 on
    host 0, or island 1 on host 1 when it registered first) starts the supervisor there and writes its address (its
    host's, not 127.0.0.1) in the job's store on the hub.
    Island 1 is SIGKILLed after its second acknowledged push; the launcher restarts it on host 1, where it reads the
    address, pulls the global model over its link and finishes: one global model, nothing acknowledged lost."""
    monkeypatch.setenv(state.STATE_DIR_ENV, str(tmp_path / "testbeds"))  # the workers inherit it
    name = "pe" + str(os.getpid() % 10000)
    bed = testbed.up(name, hosts=2, rate="100mbit")
    try:
        task, hold = gated_digits(tmp_path)
        hold.write_text(str(2 * 4 + 1))  # every island stops at its first forward after its second push
        run_dir = tmp_path / "run"
        values = dict(QUIET_ELASTIC, task=task, workers=2, islands=2, outer="ps:inner_steps=4,servers=1")
        values.update(steps=40, global_batch=16, heartbeat_timeout=5.0, max_restarts=1, testbed=name)
        cfg = from_mapping(dict(values, run_dir=str(run_dir)))
        cfg.task.options.update(hold=str(hold))
        cfg = validate(cfg)
        seen: dict = {}
        errors: list = []

        def fault(address, workers):
            try:
                raw = connect(*parse_address(address), netns=bed.hub)  # the job's store, on the hub
                token = (run_dir / "token").read_text().strip()
                store = authed(raw, ControlAuth(token, JobSpec.read(raw, token, 30.0).job_id, "observer"))

                wait_for_acked_pushes(store, 1, 2)
                seen["address"] = store.get("ps/address").decode()
                seen["killed"] = kill_served_island_at_its_gate(store, hold, 1, workers[1].proc.pid, "w1.1")
            except BaseException as e:  # noqa: BLE001 - surfaced after the job
                errors.append(e)
            finally:
                hold.unlink(missing_ok=True)  # never leave the job waiting

        out = io.StringIO()
        code = launch_elastic(
            cfg, run_dir, out=out, on_started=lambda a, w, c: threading.Thread(target=fault, args=(a, w)).start()
        )
        log = out.getvalue()
        assert not errors, (errors, log)
        assert code == 0, log
        assert "restarting island 1 (restart 1 of 1) as w1.1" in log, log
        # the host of the first epoch's rank 0 (island 0 unless island 1 registered first), reached over the links
        assert seen["address"].split(":")[0] in (bed.host(0).ip, bed.host(1).ip), seen
        recs = {p.stem: json.loads(p.read_text()) for p in (run_dir / "elastic").glob("w*.json")}
        assert set(recs) == {"w0", "w1.1"}, log
        assert recs["w0"]["global_sha256"] == recs["w1.1"]["global_sha256"]
        ends = {n: next(e for e in r["final"]["events"] if e["type"] == "served_end") for n, r in recs.items()}
        assert all(e["final"] for e in ends.values()) and ends["w0"]["version"] == ends["w1.1"]["version"], ends
        # with quorum 1 every applied push is a version: w0's, the killed w1's (read at the kill) and w1.1's
        assert ends["w0"]["version"] == ends["w0"]["pushes"] + ends["w1.1"]["pushes"] + seen["killed"]["pushes"]
    finally:
        testbed.down(name)
