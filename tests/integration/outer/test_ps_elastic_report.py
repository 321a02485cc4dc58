"""The servers' report reaches run.json in an elastic job whose island 0 was killed (issue #36;
docs/parameter-server.md, "What the servers report"): `islands train --elastic --max-restarts 1 --outer
ps:inner_steps=4,servers=1`, 2 islands of one worker on digits. Island 0 started the supervisor and is SIGKILLed
mid-round, then restarted as a new process; the island that writes run.json (the last epoch's rank 0) never started
the service, yet its record holds the servers' counts, CPU and memory, handed over through the service's store, and
the service's temporary directory is removed once, by the supervisor. Before, only the island that started the
service read the report (from the directory), so a run with that fault had no `parameter_server` section."""

from __future__ import annotations

import json
import time

from test_ps_elastic import LEASE, H, _events, _kill_island_0_mid_round
from test_ps_train import _service_processes


def test_the_report_reaches_run_json_after_the_island_that_started_the_service_was_killed(tmp_path):
    before = _service_processes()
    log, recs, seen = _kill_island_0_mid_round(tmp_path, f"ps:inner_steps={H},servers=1,lease={LEASE}", steps=24)
    ends = {n: _events(r, "served_end")[0] for n, r in recs.items()}
    applied = ends["w1"]["pushes"] + ends["w0.1"]["pushes"] + seen["killed"]["pushes"]
    assert ends["w1"]["version"] == applied > 0, (ends, seen)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert "parameter_server" in run, log
    report = run["parameter_server"]
    assert report["mode"] == "processes" and report["stop"] == "done", report
    assert report["complete"] and report["missing"] is None, report
    (server,) = report["servers"]
    # every push the three island processes had acknowledged, counted where it was applied; a push may be refused as
    # too stale (max_staleness 4), and the survivors' refusals are among the server's (the killed one's are unknown)
    assert server["pushes_applied"] == applied, (server, ends, seen)
    assert server["pushes_refused"] >= ends["w1"]["refused"] + ends["w0.1"]["refused"], (server, ends)
    assert server["restarts"] == 0 and server["processes"][0]["final"], server
    assert server["cpu_seconds"] > 0 and server["peak_memory_bytes"] > 0 and server["peak_memory"] == "max_rss"
    assert report["cpu_seconds"] == server["cpu_seconds"]
    assert report["supervisor"]["cpu_seconds"] > 0 and report["supervisor"]["max_rss_bytes"] > 0, report
    deadline = time.monotonic() + 30
    while _service_processes() - before:  # the supervisor and its server end with the job
        assert time.monotonic() < deadline, _service_processes() - before
        time.sleep(0.1)
    # the temporary directory the killed island made is gone: nobody needed it for the report
    assert len(seen["dir"]) == 1 and not seen["dir"][0].exists(), seen["dir"]
