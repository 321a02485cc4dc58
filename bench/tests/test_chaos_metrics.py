"""The chaos experiment's bookkeeping (no job needed): its seeded campaign, the stall per event and the false
deaths it reads from the launcher's log."""

import json

import pytest

from islands_bench.experiments.chaos import (
    Event,
    _failures,
    _steps_per_second,
    campaign,
    detection_per_event,
    false_deaths,
    stall_per_event,
)


def test_the_campaign_is_seeded_heals_every_etcd_kill_and_ends_with_the_launcher():
    kinds = campaign(40, seed=3)
    assert kinds == campaign(40, seed=3) and len(kinds) == 40 and kinds[-1] == "kill-launcher"
    for i, k in enumerate(kinds):
        if k == "kill-etcd-member":
            assert kinds[i + 1] == "heal-etcd-member"


def test_stall_is_the_gap_across_an_event_minus_the_usual_gap_max_over_leaders():
    progress = {"i0w0": [0.0, 0.1, 0.2, 0.3, 2.3, 2.4], "i1w0": [0.05, 0.15, 0.25, 0.35, 0.45, 0.55]}
    (stall, none) = stall_per_event(progress, [1.0, 10.0])
    assert abs(stall - 1.9) < 1e-9  # i0w0's 2.0 s gap minus its usual 0.1 s; i1w0 spans no part of it
    assert none is None  # no leader trained on both sides


def test_the_failover_chain_times_the_first_failure_naming_the_hit_island(tmp_path):
    live = tmp_path / "live"
    live.mkdir()

    def failure(t, gone):
        ev = {
            "type": "membership",
            "change.type": "failure",
            "change.gone": json.dumps(gone),
            "change.detected": t,
            "change.formed": t + 0.05,
        }
        return json.dumps({"t": t + 0.1, "kind": "event", "event": ev})

    (live / "i1w0.jsonl").write_text(
        "\n".join(
            [
                json.dumps({"t": 0.0, "kind": "metrics", "step": 10}),
                failure(9.0, ["i2w0"]),  # before the event: another one's
                failure(11.6, ["i0w0.3"]),  # the frozen follower's leader: its island
                failure(11.9, ["i0w0.3"]),  # a later member's view of the same failure
                '{"t": 12, "kind": "ev',  # a line cut by a SIGKILL
            ]
        )
    )
    (live / "i2w0.jsonl").write_text(failure(11.7, ["i0w0.3"]))
    events = [
        Event("freeze-worker", at=10.0, hit=("i0w1.3",)),
        Event("kill-etcd-member", at=10.5),
        Event("kill-worker", at=20.0, hit=("i1w0",)),
    ]
    frozen, etcd, unseen = detection_per_event(_failures(tmp_path), events)
    assert abs(frozen["detect_s"] - 1.6) < 1e-9 and abs(frozen["form_s"] - 0.05) < 1e-9
    assert etcd is None and unseen is None  # it hit no worker; no member logged its failure


def _launcher_log(tmp_path, text: str):
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "launcher.log").write_text(text)
    return run


def test_false_deaths_are_the_workers_no_event_hit(tmp_path):
    run = _launcher_log(
        tmp_path,
        "islands: worker i1w1: no heartbeat for 1.6 s (stopped, cut off or hung); killing it\n"
        "islands: worker i1w1 left (killed by SIGKILL); the others carry on\n"
        "islands: worker i0w0: no heartbeat for 1.6 s (stopped, cut off or hung); killing it\n"
        "islands: worker i2w1.1 left (exit code 1); the others carry on\n"
        "islands: island 1 left the job (i1w1: killed by SIGKILL)\n",
    )
    assert false_deaths(run, {"i0w0"}) == ["i1w1", "i2w1.1"]  # i0w0 was frozen by an event
    assert false_deaths(tmp_path / "missing", set()) == []
    # an event on a follower takes its island's leader out too (exit code 1): by design, not a false death
    (run / "launcher.log").write_text(
        "islands: worker i2w1.20: no heartbeat for 1.6 s (stopped, cut off or hung); killing it\n"
        "islands: worker i2w0.20 left (exit code 1); the others carry on\n"
        "islands: worker i2w0.21 left (exit code 1); the others carry on\n"
    )
    assert false_deaths(run, {"i2w1.20"}) == ["i2w0.21"]  # another incarnation's leader was not hit


class _Etcd:
    def __init__(self, holder):
        self.holder, self.asked = holder, []

    def coordinator(self, namespace):
        self.asked.append(namespace)
        return self.holder


class _Running:  # the launcher, as _apply sees it: still running
    def poll(self):
        return None


@pytest.mark.integration  # starts a process to kill
def test_kill_coordinator_kills_whoever_holds_the_lease(tmp_path, monkeypatch):
    import random
    import subprocess

    from islands_bench.experiments import chaos
    from islands_bench.experiments.chaos import Event, _apply

    whole = {0: [], 1: []}
    monkeypatch.setattr(chaos, "_whole_islands", lambda run_dir: whole)
    host = subprocess.Popen(["sleep", "60"])
    (tmp_path / "job_host.json").write_text(
        json.dumps({"address": "etcd://10.0.0.1:2379/islands-abc", "pid": host.pid})
    )
    etcd, state = _Etcd("job-host"), {}
    ev = Event("kill-coordinator")
    _apply(ev, tmp_path, launcher=_Running(), etcd=etcd, bed=None, rng=random.Random(0), state=state)
    assert host.wait(timeout=10) == -9 and ev.applied and ev.target == "job host" and state["host_killed"]
    assert etcd.asked == ["islands-abc"]
    # later the lease is a worker's; one that is no process of this run is skipped, saying who
    ev = Event("kill-coordinator")
    _apply(ev, tmp_path, launcher=_Running(), etcd=_Etcd("i1w0.3"), bed=None, rng=random.Random(0), state=state)
    assert not ev.applied and "'i1w0.3' is no process of this job" in ev.note
    # and like any fault on a worker it waits for two whole islands: with one, it is skipped (session 18: the
    # seat's worker was killed while both other islands restarted, and the job lost its last member)
    monkeypatch.setattr(chaos, "WAIT_S", 0.3)
    del whole[1]
    ev, asker = Event("kill-coordinator"), _Etcd("i0w0.3")
    _apply(ev, tmp_path, launcher=_Running(), etcd=asker, bed=None, rng=random.Random(0), state=state)
    assert not ev.applied and ev.note.startswith("skipped: 1 whole island(s)") and asker.asked == []


def test_events_are_on_disk_as_they_happen(tmp_path):
    # a run that fails after its campaign (session 18: the fault-free baseline) keeps what was applied, and when
    from islands_bench.experiments.chaos import Event, _save_events

    events = [Event("kill-worker", at=12.5, target="i0w1", hit=("i0w1",), applied=True), Event("freeze-worker")]
    _save_events(tmp_path, events)
    saved = json.loads((tmp_path / "events.json").read_text())
    assert saved[0] == {
        "kind": "kill-worker",
        "at": 12.5,
        "target": "i0w1",
        "hit": ["i0w1"],
        "waited_s": 0.0,
        "applied": True,
        "note": "",
    }
    assert saved[1]["kind"] == "freeze-worker" and not saved[1]["applied"]
    assert not (tmp_path / "events.json.tmp").exists()  # written whole, then moved into place


def test_the_probe_rate_is_read_while_every_island_trained(tmp_path):
    live = tmp_path / "live"
    live.mkdir()

    def stream(name, rows):
        (live / f"{name}.jsonl").write_text(
            "\n".join(json.dumps({"t": t, "kind": "metrics", "step": s}) for t, s in rows)
        )

    # three islands at 10 steps/s until t=10; island 1 then left and the other two ran at 20 steps/s
    stream("i0w0", [(t, 10 * t) for t in range(11)] + [(10 + t, 100 + 20 * t) for t in range(1, 11)])
    stream("i1w0", [(t, 10 * t) for t in range(11)])
    stream("i2w0", [(t, 10 * t) for t in range(11)] + [(10 + t, 100 + 20 * t) for t in range(1, 11)])
    assert abs(_steps_per_second(tmp_path) - 10.0) < 1e-9
    # only two islands ever trained (one lost at start-up): their rate, scaled to three islands' share of the CPUs
    (live / "i1w0.jsonl").unlink()
    stream("i0w0", [(t, 30 * t) for t in range(11)])
    stream("i2w0", [(t, 30 * t) for t in range(11)])
    assert abs(_steps_per_second(tmp_path) - 20.0) < 1e-9


def test_a_worker_the_reaper_spared_as_waiting_for_a_cpu_is_no_false_death_unless_killed_later(tmp_path):
    """Session 21's full run counted the reaper's spare line (it contains "no heartbeat for") as a death."""
    run = _launcher_log(
        tmp_path,
        "islands: worker i2w1: no heartbeat for 1.7 s, but its process is waiting for a CPU (it used 0.35 s of CPU in "
        "1.6 s); not killing it before 4.5 s of silence\n"
        "islands: worker i0w1: no heartbeat for 1.6 s, but its process is waiting for a CPU (it used 0.01 s of CPU in "
        "1.6 s); not killing it before 4.5 s of silence\n"
        "islands: worker i0w1: no heartbeat for 4.5 s (stopped, cut off or hung; its process is running); killing it\n",
    )
    assert false_deaths(run, set()) == ["i0w1"]
