"""The parameter server in an elastic job (issue #36; docs/parameter-server.md, "Elastic jobs"): `islands train
--elastic --max-restarts 1 --outer ps:inner_steps=4,servers=1`, 2 islands of one worker on digits. Island 0, the
one that started the server's supervisor, is SIGKILLed mid-round; the service lives on (its own session), the
launcher restarts the island, which reads the service's address from the job's store, pulls the global model from
the server and starts at its predecessor's last acknowledged step; the job ends 0 with both survivors on the
server's final model, and the server's version counts every acknowledged push of all three island processes, the
killed one's included. The same with islands of two workers (ddp inside, a BatchNorm model): island 0's follower is
killed, the launcher restarts the whole island, and the servers count islands, not workers.

Processes, not threads: what is tested is the elastic runtime's launcher, restart and store, and a SIGKILL of a
whole island process while the server processes live on."""

from __future__ import annotations

import io
import json
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from test_ps_train import _service_processes

from harness.elastic import QUIET_ELASTIC, gated_digits, kill_served_island_at_its_gate, wait_for_acked_pushes
from islands.app.launch import launch_elastic
from islands.app.validate import validate
from islands.config import from_mapping
from islands.runtime.elastic.island_comm import worker_name
from islands.runtime.elastic.membership import observe

HEARTBEAT = 5.0  # seconds; generous: the test machine is shared and loaded (a false death would fail it)
H = 4
# the servers' lease on an island's heartbeat, generous for the same reason: at the default 2 s a loaded machine let
# a live island's heartbeat stand still that long (2 of 12 runs, six at once on 2 cores) and the server counted it
# lapsed; the other island's DONE was then answered final early, and the pushes after it (refused since then, see
# test_ps_service's woken island) are missing from the counts this test checks
LEASE = 6


def _names(directory: Path, address: str) -> bool:
    try:
        return (directory / "address").read_text().strip() == address
    except OSError:
        return False


def _events(record: dict, kind: str) -> list[dict]:
    return [e for e in record["final"]["events"] if e["type"] == kind]


def _kill_island_0_mid_round(
    tmp_path: Path, outer: str, steps: int, token: str | None = None, model: str = "", k: int = 1, victim: int = -1
) -> tuple[str, dict, dict]:
    """`islands train --elastic --max-restarts 1` of 2 islands of `k` workers (ddp inside) on gated digits with
    `outer`; once island 0 has two acknowledged pushes its worker `victim` (a local index; by default the last: k = 1,
    the island; else a follower, whose leader the launcher stops with it) is SIGKILLed at its gate and the island
    restarted. Returns (log, the
    survivors' records, what the fault saw: the service's address in the job's store and the killed island's
    numbers)."""
    task, hold = gated_digits(tmp_path)
    hold.write_text(str(2 * H + 1))  # every island stops at its first forward after its second push: a busy host
    # once let island 0 finish its remaining steps before a gate set after the second ack could catch it
    run_dir = tmp_path / "run"
    values = dict(QUIET_ELASTIC, task=task, workers=2 * k, islands=2, outer=outer, inner="ddp" if k > 1 else "auto")
    values.update(steps=steps, global_batch=16, heartbeat_timeout=HEARTBEAT, max_restarts=1, run_dir=str(run_dir))
    cfg = from_mapping(values)
    cfg.task.options.update(hold=str(hold), **({"model": model} if model else {}))
    cfg = validate(cfg)
    seen: dict = {}
    errors: list = []

    def fault(address, workers):
        try:
            store = observe(address, token or (run_dir / "token").read_text().strip())
            wait_for_acked_pushes(store, 0, 2)
            seen["address"] = where = store.get("ps/address").decode()
            # a service of island 0's own: its temporary directory, the one whose address file names its store
            seen["dir"] = [p for p in Path(tempfile.gettempdir()).glob("islands-ps-*") if _names(p, where)]
            killed = workers[victim % k]  # a worker of island 0 (the launcher starts island 0's k workers first)
            assert killed.name == worker_name(0, victim % k, k), killed.name
            seen["killed"] = kill_served_island_at_its_gate(store, hold, 0, killed.proc.pid, restarted[0])
        except BaseException as e:  # noqa: BLE001 - surfaced after the job
            errors.append(e)
        finally:
            hold.unlink(missing_ok=True)  # never leave the job waiting

    # the survivors' and the restarted workers' names: w0.1, w1 (k = 1) or i0w0.1, i0w1.1, i1w0, i1w1 (k = 2)
    restarted = [worker_name(0, j, k, 1) for j in range(k)]
    survivors = restarted + [worker_name(1, j, k) for j in range(k)]
    out = io.StringIO()
    code = launch_elastic(
        cfg, run_dir, out=out, on_started=lambda a, w, c: threading.Thread(target=fault, args=(a, w)).start()
    )
    log = out.getvalue()
    assert not errors, errors
    assert code == 0, log
    assert f"restarting island 0 (restart 1 of 1) as {', '.join(restarted)}" in log, log
    recs = {p.stem: json.loads(p.read_text()) for p in (run_dir / "elastic").glob("*w*.json")}
    assert set(recs) == set(survivors), log  # the killed island wrote nothing
    return log, recs, seen


def test_a_killed_island_restarts_from_the_server_and_loses_no_acknowledged_push(tmp_path):
    before = _service_processes()
    log, recs, seen = _kill_island_0_mid_round(tmp_path, f"ps:inner_steps={H},servers=1,lease={LEASE}", steps=40)
    run_dir = tmp_path / "run"
    # both survivors hold the server's final model, bit for bit
    assert recs["w1"]["global_sha256"] == recs["w0.1"]["global_sha256"]
    # the restarted island entered through the service: at its predecessor's last acknowledged step, no transfer
    (entered,) = _events(recs["w0.1"], "entered")[:1]
    assert entered["via"] == "service" and entered["step"] == seen["killed"]["step"] >= 2 * H
    assert recs["w0.1"]["data_shard"] == [0, 2]  # island 0's data, as its predecessor
    # nothing acknowledged was lost: with quorum 1 each applied push is one version, and the final version counts
    # the pushes of w1, of the killed w0 (read at the kill) and of w0.1
    ends = {n: _events(r, "served_end")[0] for n, r in recs.items()}
    assert all(e["final"] for e in ends.values()), ends
    assert ends["w1"]["version"] == ends["w0.1"]["version"], ends
    applied = ends["w1"]["pushes"] + ends["w0.1"]["pushes"] + seen["killed"]["pushes"]
    assert ends["w1"]["version"] == applied, (ends, seen)
    assert len({ends["w1"]["island"], ends["w0.1"]["island"], seen["killed"]["island"]}) == 3  # a new island each
    # w0.1 trained the steps its predecessor had not pushed: 40 - the killed island's step, in rounds of H
    assert ends["w0.1"]["pushes"] + ends["w0.1"]["refused"] == -(-(40 - entered["step"]) // H)
    # the members put the restarted island into the job's last epoch at the end, not at a round boundary
    (join,) = _events(recs["w1"], "join")
    assert join["via"] == "end" and join["joined"] == ["w0.1"] and join["size"] == 2
    run = json.loads((run_dir / "run.json").read_text())
    assert run["summary"]["steps"] == 40
    # the servers' report reaches run.json although the island that started the service was killed: the supervisor
    # handed it over through its store ("What the servers report"); before, only the starter read it
    report = run["parameter_server"]
    assert report["mode"] == "processes" and report["stop"] == "done", report
    assert report["complete"] and report["missing"] is None, report
    (server,) = report["servers"]
    # every acknowledged push counted where it was applied; a push may be refused as too stale (max_staleness 4),
    # and the survivors' refusals are among the server's (the killed one's are unknown)
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
    # the island that made the service's temporary directory was killed: the supervisor removed it as it ended
    assert len(seen["dir"]) == 1 and not seen["dir"][0].exists(), seen["dir"]


def test_islands_of_two_workers_push_as_islands_and_a_killed_follower_restarts_its_island(tmp_path):
    """`--workers 4 --islands 2 --inner ddp --elastic` with a BatchNorm model: island 0's follower is SIGKILLed
    mid-round; the launcher stops its leader (the one that started the supervisor) and restarts both, whose leader
    pulls from the servers and hands the model and its step to its follower. Each island is one participant (its
    leader pushes, its follower takes every answer from it), so the servers count the pushes of 3 island processes,
    not of 6 workers; the 4 survivors end on one model, buffers included (the answers carry the islands' mean
    statistics and the end averages them once more: either alone makes the digests agree, so this checks the
    outcome), and the servers' report reaches run.json. Pulls are compressed (ps_pulls): each island process's leader
    gets a whole first answer and steps after it, and the copy of the killed island's goes when it lapses."""
    outer = f"ps:inner_steps={H},servers=1,lease={LEASE},pulls=(int8)"
    log, recs, seen = _kill_island_0_mid_round(tmp_path, outer, steps=40, model="bn-cnn", k=2)
    assert "island 0 left the job" in log, log
    # every worker of both islands holds the server's final model, bit for bit: within an island and across them
    assert len({r["global_sha256"] for r in recs.values()}) == 1, {n: r["global_sha256"] for n, r in recs.items()}
    # the restarted leader entered through the service at its predecessor's last acknowledged step, its follower
    # through it at the same step; each keeps its own data shard (island index * 2 + local of 4)
    (entered,) = _events(recs["i0w0.1"], "entered")[:1]
    assert entered["via"] == "service" and entered["step"] == seen["killed"]["step"] >= 2 * H
    (follower,) = _events(recs["i0w1.1"], "entered")
    assert follower["via"] == "i0w0.1" and follower["step"] == entered["step"]
    assert [recs[n]["data_shard"] for n in ("i0w0.1", "i0w1.1", "i1w0", "i1w1")] == [[0, 4], [1, 4], [2, 4], [3, 4]]
    # a follower's end is its leader's: the same island number on the servers, final version and pushes
    ends = {n: _events(r, "served_end")[0] for n, r in recs.items()}
    assert all(e["final"] for e in ends.values()), ends
    for leader, mate in (("i0w0.1", "i0w1.1"), ("i1w0", "i1w1")):
        assert {key: v for key, v in ends[mate].items() if key != "time"} == {
            key: v for key, v in ends[leader].items() if key != "time"
        }, ends
    # one number per island process, the leaders' (0, 1 and 2 taken: no follower took one)
    numbers = {ends["i1w0"]["island"], ends["i0w0.1"]["island"], seen["killed"]["island"]}
    assert numbers == {0, 1, 2}, (ends, seen)
    # the pushes are the islands': the survivors' leaders' and the killed island's acknowledged ones
    applied = ends["i1w0"]["pushes"] + ends["i0w0.1"]["pushes"] + seen["killed"]["pushes"]
    assert ends["i1w0"]["version"] == applied, (ends, seen)
    assert ends["i0w0.1"]["pushes"] + ends["i0w0.1"]["refused"] == -(-(40 - entered["step"]) // H)
    (join,) = _events(recs["i1w0"], "join")
    assert join["via"] == "end" and join["joined"] == ["i0w0.1"] and join["size"] == 2
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["summary"]["steps"] == 40 and run["summary"]["workers"] == 4 and run["summary"]["islands"] == 2
    (server,) = run["parameter_server"]["servers"]
    assert run["parameter_server"]["stop"] == "done" and server["pushes_applied"] == applied, (server, ends, seen)
    # 3 island processes' first pulls whole, later answers int8 steps; no copy left once they are done or lapsed
    pulls = server["pulls"]
    assert pulls["whole"] >= 3 and pulls["coded"] >= applied - 3 and pulls["copies"] == 0, pulls
    # the followers (ranks 1 and 3 of the last epoch) made no call to the servers: their leaders relayed
    calls = [rank["calls"] for rank in run["comm"]["per_rank"]]
    assert len(calls) == 4 and all(not [c for c in calls[r] if c.startswith("ps_")] for r in (1, 3)), calls
    assert all(calls[r]["ps_push"] >= 1 for r in (0, 2)), calls
    # the model the job keeps carries trained statistics (a fresh BatchNorm's are mean 0, variance 1)
    kept = load_file(tmp_path / "run" / "model" / "model.safetensors")
    (var,) = [v for k, v in kept.items() if k.endswith("bn.running_var")]
    (mean,) = [v for k, v in kept.items() if k.endswith("bn.running_mean")]
    assert not torch.equal(var, torch.ones_like(var)) and not torch.equal(mean, torch.zeros_like(mean))


def test_an_elastic_job_on_a_server_host_survives_the_killed_island_that_configured_it(tmp_path, monkeypatch):
    """at= in an elastic job: the first epoch's rank 0 sends the host (`islands ps-host`'s ServerHost, a thread of
    the test with forked shard servers) the sealed configuration and writes the host's address in the job's store.
    SIGKILLed mid-round, it is restarted as a joiner, which reads the address there and derives the payload tags from
    the configuration the host holds (configuring it again would be refused). Both survivors end on the host's final
    model, the host's version counts every acknowledged push of the three island processes, and the host's report
    comes back into run.json: the host stays until both survivors have taken it."""
    from harness.ps import ForkedShard
    from islands.sync.outer import ps_host

    token = "ps-elastic-host-test"
    monkeypatch.setenv("ISLANDS_TOKEN", token)  # the host's, and the job's (the launcher takes it)
    said: list[str] = []
    host = ps_host.ServerHost(tmp_path / "host", token, say=said.append, starter=ForkedShard, report_wait_s=30)
    served = threading.Thread(target=host.run, daemon=True)
    served.start()
    outer = f"ps:inner_steps={H},servers=1,lease={LEASE},at='{host.host}:{host.port}'"
    log, recs, seen = _kill_island_0_mid_round(tmp_path, outer, steps=24, token=token)
    run_dir = tmp_path / "run"
    assert seen["address"] == f"{host.host}:{host.port}" and seen["dir"] == []  # the host's, not island 0's own
    assert recs["w1"]["global_sha256"] == recs["w0.1"]["global_sha256"]
    (entered,) = _events(recs["w0.1"], "entered")[:1]
    assert entered["via"] == "service" and entered["step"] == seen["killed"]["step"] >= 2 * H
    ends = {n: _events(r, "served_end")[0] for n, r in recs.items()}
    assert all(e["final"] for e in ends.values()), ends
    applied = ends["w1"]["pushes"] + ends["w0.1"]["pushes"] + seen["killed"]["pushes"]
    assert ends["w1"]["version"] == ends["w0.1"]["version"] == applied, (ends, seen)
    served.join(60)
    assert not served.is_alive()  # the host took the job's stop, its servers left, its report was taken
    # by both survivors, not only the first to ask (test_ps_host_report.py: a host process left at the first take)
    assert "every island answered final took the report (2)" in said[-1], said
    report = json.loads((run_dir / "run.json").read_text())["parameter_server"]
    assert report["mode"] == "processes" and report["stop"] == "done"
    assert report["servers"][0]["pushes_applied"] == applied
