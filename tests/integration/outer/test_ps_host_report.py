"""The servers' report from a server host of its own in an elastic job (issue #36; docs/parameter-server.md, "What
the servers report"): every island takes it back at its end, and the one that writes run.json may take it after
another island did (island 0 may have been restarted under another number). So `islands ps-host` stays until every
island answered final has taken it, as an elastic job's own supervisor does (ps_report.hand_over).

A real `islands ps-host` process, not a ServerHost thread: a thread's store outlives its run, which hid the host
leaving at the first take. The islands are two links of this process, each ended by the strategy's own
`close_service`, one after the other."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from harness.dict_store import DictStore
from harness.ps import done_together
from islands.sync.outer import ps_host
from islands.sync.outer.ps import OuterRule, parameter_server
from islands.sync.outer.ps_elastic import ElasticService
from islands.sync.outer.ps_link import Message
from islands.sync.outer.ps_remote import RemoteLink
from islands.sync.outer.ps_service import ServiceConfig
from islands.sync.outer.ps_wire import PUSH

TOKEN = "ps-host-report-test"
LEASE = 5.0  # the islands' heartbeat lease; the host waits 2 x LEASE for a silent island
TIMEOUT = 20.0  # an island's bound on each wait for the host (main's code: its late island waited 2 x this to fail)


def test_a_host_process_stays_until_every_elastic_island_took_the_report(tmp_path, monkeypatch):
    monkeypatch.setenv(ps_host.TOKEN_ENV, TOKEN)
    host = subprocess.Popen(
        [sys.executable, "-m", "islands", "ps-host", "--dir", str(tmp_path / "host"), "--wait", "60"],
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        text=True,
    )
    links: list[RemoteLink] = []
    try:
        assert host.stdout is not None
        first = host.stdout.readline()  # "islands ps-host: listening on 127.0.0.1:PORT; waiting for a job"
        where = first.split("listening on ", 1)[1].split(";")[0]
        address = ps_host.parse_at(where)
        # an elastic job's configuration: its service outlives the island that started it
        config = ServiceConfig(
            torch.arange(10.0), OuterRule("sgd", 1.0, 0.0), lease_s=LEASE, max_staleness=100, ends_with_starter=False
        )
        tags = [ps_host.configure(address, config, TOKEN, 60), ps_host.job_tags(address, TOKEN, 60)]
        links = [RemoteLink(address, i, config.bounds, TIMEOUT, LEASE, None, tags[i], None).start() for i in (0, 1)]
        for link in links:
            link.send(Message(PUSH, link.island, 0, 4.0, torch.ones(10)))
        done_together(links)  # DONE is answered once no island is still training
        islands = []
        for i in (0, 1):  # each island's strategy as an elastic job's, ended by its own close_service
            strategy = parameter_server(4, servers=1, lease=LEASE, timeout=TIMEOUT, at=where)
            strategy.elastic, strategy.island = ElasticService(DictStore(), f"w{i}", i, 5.0), i
            islands.append(strategy)
        # island 1 ends first and takes the report; island 0, the one that writes run.json here, comes after
        islands[1].close_service(links[1])
        try:  # the host that left on the first take was gone by now
            host.wait(2.0)
        except subprocess.TimeoutExpired:
            pass
        islands[0].close_service(links[0])
        reports = [s.run_report()["parameter_server"] for s in islands]
        assert host.wait(30) == 0
        said = host.stdout.read()
    finally:
        for link in links:
            link.close()
        if host.poll() is None:
            host.kill()
    for report in reports:  # both, the later one included: not "the server host could not be asked"
        assert report["complete"] and report["missing"] is None, report
        assert report["servers"][0]["pushes_applied"] == 2 and report["stop"] == "done", report
    assert "every island answered final took the report" in said, said
