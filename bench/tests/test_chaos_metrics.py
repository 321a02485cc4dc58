"""The chaos experiment's bookkeeping (no job needed): its seeded campaign, the stall per event and the false
deaths it reads from the launcher's log."""

from islands_bench.experiments.chaos import campaign, false_deaths, stall_per_event


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


def test_false_deaths_are_the_workers_no_event_hit(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "launcher.log").write_text(
        "islands: worker i1w1: no heartbeat for 1.6 s (stopped, cut off or hung); killing it\n"
        "islands: worker i1w1 left (killed by SIGKILL); the others carry on\n"
        "islands: worker i0w0: no heartbeat for 1.6 s (stopped, cut off or hung); killing it\n"
        "islands: worker i2w1.1 left (exit code 1); the others carry on\n"
        "islands: island 1 left the job (i1w1: killed by SIGKILL)\n")
    assert false_deaths(run, {"i0w0"}) == ["i1w1", "i2w1.1"]  # i0w0 was frozen by an event
    assert false_deaths(tmp_path / "missing", set()) == []
