"""The parameter server in an elastic job outlives every island that started it (issue #36; docs/parameter-server.md,
"Elastic jobs"): `islands train --elastic --max-restarts 1 --outer ps:inner_steps=4,servers=1`, 2 islands of one
worker on digits. Island 1 is SIGKILLed and restarted; while its restart trains, island 0 is SIGKILLed too, so no
island of the first epoch is alive. Nobody has to admit a restarted island (it pulls the global model from the
service), so the launcher restarts island 0 all the same and stops no restarted island for want of admission; at the
end the restarted islands, with no member left to put them into an epoch, form the job's last epoch themselves, and
its rank 0 writes run.json. Without that rule the launcher refused island 0's restart ("no other island is alive to
admit it") and stopped island 1's ("the job ended before its island was admitted"): the job failed.

Processes, not threads: what is tested is the elastic launcher's restarts and the joiners' end over the job's store
while the server processes live on."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

from test_ps_train import _service_processes
from torch.distributed import DistNetworkError

from harness.elastic import QUIET_ELASTIC, assert_nothing_half_written, gated_digits, wait, wait_for_acked_pushes
from islands.app.launch import launch_elastic
from islands.app.validate import validate
from islands.config import from_mapping
from islands.runtime.elastic.membership import observe

HEARTBEAT = 5.0  # seconds, as test_ps_elastic: generous on a shared, loaded machine (a false death would fail it)
H = 4
LEASE = 6  # the servers' lease on an island's heartbeat, as test_ps_elastic (a starved heartbeat must not lapse)
STEPS = 40
WAIT_S = 90.0  # for each fault's step; a job that ended instead fails the test at once (the launcher returned)


def _events(record: dict, kind: str) -> list[dict]:
    return [e for e in record["final"]["events"] if e["type"] == kind]


def _kill_at_gate(store, hold: Path, island: int, pid: int, restarted: str, over: threading.Event) -> dict:
    """SIGKILL island `island`'s process `pid` where it waits at the gate (mid-round, no push in flight) and wait
    for its restart `restarted` to pull the global model; returns the island's ps/clock entry at the kill."""

    def until(cond, what: str) -> None:
        def met() -> bool:
            try:
                return over.is_set() or cond()
            except DistNetworkError:  # the job's store went away: the job ended
                return True

        wait(met, what, timeout=WAIT_S)
        assert not over.is_set() and cond(), f"the job ended while waiting for {what}"

    until(lambda: Path(f"{hold}.{pid}").exists(), f"island {island} at the gate")
    killed = json.loads(store.get(f"ps/clock/{island}"))
    os.kill(pid, signal.SIGKILL)
    until(lambda: store.check([f"ps/island/{restarted}"]), f"{restarted}'s pull")
    return killed


def test_every_first_island_killed_in_turn_the_restarted_ones_finish_the_job(tmp_path):
    before = _service_processes()
    task, hold = gated_digits(tmp_path)
    hold.write_text(str(2 * H + 1))  # every island process stops at its first forward after its second push
    run_dir = tmp_path / "run"
    values = dict(QUIET_ELASTIC, task=task, workers=2, islands=2, outer=f"ps:inner_steps={H},servers=1,lease={LEASE}")
    values.update(steps=STEPS, global_batch=16, heartbeat_timeout=HEARTBEAT, max_restarts=1, run_dir=str(run_dir))
    cfg = from_mapping(values)
    cfg.task.options.update(hold=str(hold))
    cfg = validate(cfg)
    killed: dict = {}
    errors: list = []
    over = threading.Event()  # the launcher returned: a fault still waiting gives up

    def fault(address, workers):
        try:
            store = observe(address, (run_dir / "token").read_text().strip())
            wait_for_acked_pushes(store, 1, 2)
            # island 1 first: its restart w1.1 pulls and trains (up to its own gate) while island 0 is killed, so
            # at that moment neither island of the first epoch is alive
            killed[1] = _kill_at_gate(store, hold, 1, workers[1].proc.pid, "w1.1", over)
            killed[0] = _kill_at_gate(store, hold, 0, workers[0].proc.pid, "w0.1", over)
        except BaseException as e:  # noqa: BLE001 - surfaced after the job
            errors.append(e)
        finally:
            hold.unlink(missing_ok=True)  # never leave the job waiting

    threads: list[threading.Thread] = []

    def started(address, workers, coordinator):
        threads.append(threading.Thread(target=fault, args=(address, workers), daemon=True))
        threads[0].start()

    out = io.StringIO()
    try:
        code = launch_elastic(cfg, run_dir, out=out, on_started=started)
    finally:
        over.set()
        hold.unlink(missing_ok=True)
    threads[0].join(WAIT_S)
    log = out.getvalue()
    assert not errors, (errors, log)
    assert code == 0, log
    for island in (1, 0):
        assert f"restarting island {island} (restart 1 of 1) as w{island}.1" in log, log
    assert "not restarted" not in log and "before its island was admitted" not in log, log
    recs = {p.stem: json.loads(p.read_text()) for p in (run_dir / "elastic").glob("w*.json")}
    assert set(recs) == {"w0.1", "w1.1"}, log  # the killed islands wrote nothing
    # each restarted island entered through the service at its predecessor's last acknowledged step, on its data
    for island in (0, 1):
        rec = recs[f"w{island}.1"]
        (entered,) = _events(rec, "entered")[:1]
        assert entered["via"] == "service" and entered["step"] == killed[island]["step"] >= 2 * H, (entered, killed)
        assert rec["data_shard"] == [island, 2]
    # both hold the server's final model, and it took the restarted islands' pushes: with quorum 1 each applied
    # push is one version, and the final version counts all four island processes' acknowledged pushes
    assert recs["w0.1"]["global_sha256"] == recs["w1.1"]["global_sha256"]
    ends = {n: _events(r, "served_end")[0] for n, r in recs.items()}
    assert all(e["final"] for e in ends.values()), ends
    assert ends["w0.1"]["version"] == ends["w1.1"]["version"], ends
    assert ends["w0.1"]["pushes"] > 0 and ends["w1.1"]["pushes"] > 0, ends
    applied = sum(e["pushes"] for e in ends.values()) + killed[0]["pushes"] + killed[1]["pushes"]
    assert ends["w0.1"]["version"] == applied, (ends, killed)
    # no member was left: the restarted islands formed the job's last epoch themselves, the same one on both
    for rec in recs.values():
        (last,) = [e for e in _events(rec, "entered") if e["via"] == "end"]
        assert last["without_members"] and last["joined"] == ["w1.1", "w0.1"], last  # slot order: w1.1 is rank 0
        assert [m[1] for m in rec["final"]["members"]] == ["w1.1", "w0.1"]
    assert len({rec["final"]["epoch"] for rec in recs.values()}) == 1
    # run.json, written by that epoch's rank 0 alone: one whole record of the full run with its final loss
    run = json.loads((run_dir / "run.json").read_text())
    assert run["summary"]["steps"] == STEPS
    assert math.isfinite(run["summary"]["final_val_loss"]), run["summary"]
    assert [p.name for p in run_dir.glob("run*.json")] == ["run.json"]
    assert_nothing_half_written(run_dir)
    deadline = time.monotonic() + 30
    while _service_processes() - before:  # the supervisor and its server end with the job
        assert time.monotonic() < deadline, _service_processes() - before
        time.sleep(0.1)
