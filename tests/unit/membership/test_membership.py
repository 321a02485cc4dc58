"""Membership pieces in one process: the token handshake, liveness, and membership state across a resume."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from islands.app.build import build_trainer
from islands.app.validate import validate
from islands.config import from_mapping
from islands.runtime.comm import CommLedger
from islands.runtime.elastic import elastic_member
from islands.runtime.elastic.membership import (
    Coordinator,
    JobSpec,
    Liveness,
    Refused,
    ask_to_join,
    connect,
    host_store,
    proof,
)
from islands.runtime.world import join_elastic


@pytest.fixture()
def job():
    server, store = host_store(0)
    lines: list[str] = []
    coord = Coordinator(store, "s3cret-token", JobSpec(workers=1), log=lines.append).start()
    yield server.port, coord, lines
    coord.stop()


def test_proof_is_bound_to_token_name_and_challenge():
    p = proof("t", "w0", "abc")
    assert p == proof("t", "w0", "abc")
    assert p != proof("u", "w0", "abc") and p != proof("t", "w1", "abc") and p != proof("t", "w0", "abd")
    assert "t" not in p.replace("t", "")  # hex digest only; nothing of the token in clear


def test_right_token_admitted_wrong_token_refused_with_clear_line(job):
    port, coord, lines = job
    first = ask_to_join(connect("127.0.0.1", port), "w0", "s3cret-token")
    assert first.initial and first.slot == 0 and first.shard == 0
    with pytest.raises(Refused, match="wrong token"):
        ask_to_join(connect("127.0.0.1", port), "mallory", "guess")
    assert any("refused 'mallory'" in line for line in lines)
    assert not any("s3cret-token" in line for line in lines)
    with pytest.raises(Refused, match="already taken"):
        ask_to_join(connect("127.0.0.1", port), "w0", "s3cret-token")
    late = ask_to_join(connect("127.0.0.1", port), "j1", "s3cret-token")
    assert not late.initial and late.slot == 1
    store = coord.store  # the launcher's authenticated view (values in the store are signed envelopes)
    assert json.loads(store.get("pending")) == [[1, "j1", late.shard]]
    assert json.loads(store.get("e/0/members")) == [[0, "w0", 0]]
    assert coord.refused == 1


@pytest.fixture()
def three():
    """A job of 3 data shards: its coordinator, and join(name) -> the Admission a worker of that name gets."""
    server, store = host_store(0)
    coord = Coordinator(store, "tok", JobSpec(workers=3), log=lambda _: None).start()

    def join(name: str):
        return ask_to_join(connect("127.0.0.1", server.port), name, "tok")

    yield coord, join
    coord.stop()


def test_a_joiner_takes_over_a_free_shard(three):
    coord, join = three
    for name in ("a", "b", "c"):
        join(name)
    coord.store.set("e/1/members", json.dumps([[0, "a", 0], [2, "c", 2]]))  # b (shard 1) left in epoch 1
    coord.store.set("latest", "1")
    assert join("d").shard == 1
    assert join("e").shard == 4 % 3  # all held: slot % workers


def test_a_restarted_worker_takes_its_dead_predecessors_shard_before_the_epoch_drops_it(three):
    coord, join = three
    for name in ("w0", "w1", "w2"):
        join(name)
    until = time.monotonic() + 10
    while not coord.store.check(["e/0/members"]):  # epoch 0 of w0, w1, w2 (shards 0, 1, 2)
        assert time.monotonic() < until
        time.sleep(0.02)
    coord.store.set("dead/w2", "killed by SIGKILL")  # the launcher's flag, then its restart: still in epoch 0
    assert join("w2.1").shard == 2
    coord.store.set("dead/w2.1", "killed by SIGKILL")  # dead again, admitted but never in an epoch (ps)
    assert join("w2.2").shard == 2
    extra = join("extra")  # w2.2 lives: every shard held
    assert extra.slot == 5 and extra.shard == 5 % 3


def test_liveness_dead_flag_is_immediate_and_stale_heartbeat_times_out():
    server, store = host_store(0)
    live = Liveness(store, timeout_s=0.3)
    store.add("hb/a", 1)
    store.add("hb/b", 1)
    assert live.gone(["a", "b"]) == set()
    store.set("dead/a", "killed by SIGKILL")
    assert live.gone(["a", "b"]) == {"a"}
    stop = threading.Event()

    def beat():
        while not stop.wait(0.05):
            store.add("hb/b", 1)

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    time.sleep(0.5)
    assert live.gone(["b"]) == set()  # beating: alive
    stop.set()
    t.join()
    seen: set[str] = set()
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:  # watched without a pause: one look after a long pause convicts no one
        seen |= live.gone(["b"])
        time.sleep(0.05)
    assert seen == {"b"}  # silent past the timeout: gone


def _solo_trainer(tmp_path, port, name):
    cfg = validate(
        from_mapping(
            dict(
                task="digits",
                workers=1,
                islands=1,
                outer="local-sgd:every=2",
                elastic=True,
                steps=6,
                global_batch=8,
                eval_every=0,
                warmup=1,
                probe=False,
                progress=False,
                inner="single",
            )
        )
    )
    world = join_elastic(f"127.0.0.1:{port}", name, "tok")
    return build_trainer(cfg, world, tmp_path), world.membership


def test_membership_and_outer_state_survive_a_resume(tmp_path):
    server, store = host_store(0)
    coord = Coordinator(store, "tok", JobSpec(workers=1), log=lambda _: None).start()
    try:
        trainer, comm = _solo_trainer(tmp_path, server.port, "w0")
        trainer.fit(6)
        state = trainer.state_dict()
        comm.leave()  # its heartbeat thread ends with the job, not beats on into later tests against a dead store
    finally:
        coord.stop()
    assert state["membership"]["epoch"] == 0 and state["membership"]["members"] == [[0, "w0", 0]]
    assert state["strategy"]["outer"]["rounds"] == 3

    server2, store2 = host_store(0)  # the resumed job: a fresh store, epoch 0 again
    coord2 = Coordinator(store2, "tok", JobSpec(workers=1), log=lambda _: None).start()
    try:
        resumed, comm2 = _solo_trainer(tmp_path, server2.port, "w0")
        resumed.load_state_dict(state)
    finally:
        coord2.stop()
    mem = resumed.state_dict()["membership"]
    assert mem["epoch"] == 1  # counts on from the saved epoch
    assert mem["events"][-1] == {"type": "resumed", "from_epoch": 0, "previous_members": [[0, "w0", 0]]}
    outer, saved = resumed.strategy.outer, state["strategy"]["outer"]
    assert outer.rounds == 3 and outer.global_flat.equal(saved["global"]) and resumed.step == 6
    comm2.leave()


def test_a_joiner_stops_waiting_when_no_member_is_alive_though_the_store_stays_up():
    # chaos, session 14: the job host and the launcher both dead, the store an etcd cluster that nobody
    # marks ended; the members finish and a restarted island waited for admission forever.
    from islands.runtime.elastic import ADMIT_LINGER_S, JobEnded

    server, prefixed = host_store(0)
    store = connect("127.0.0.1", server.port)
    store.set("e/0/members", json.dumps([[0, "w0", 0], [1, "w1", 1]]))
    store.set("dead/w0", "finished")  # w1 still beats: the wait must go on while it does
    comm = elastic_member(connect("127.0.0.1", server.port), "j1", CommLedger(), heartbeat_timeout=1.0)
    outcome: list[BaseException] = []

    def joiner():
        try:
            comm.enter(object(), None)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    thread = threading.Thread(target=joiner, daemon=True)
    thread.start()
    beat, deadline = 0, time.monotonic() + 1.0 + ADMIT_LINGER_S + 2.0
    while time.monotonic() < deadline:  # w1 alive for longer than the joiner's whole patience
        beat += 1
        store.set("hb/w1", str(beat))
        time.sleep(0.1)
    assert thread.is_alive() and not outcome, outcome
    store.set("dead/w1", "finished")
    gone = time.monotonic()
    thread.join(1.0 + ADMIT_LINGER_S + 10)
    assert not thread.is_alive() and len(outcome) == 1 and isinstance(outcome[0], JobEnded), outcome
    assert "no member of the job's newest epoch has been alive" in str(outcome[0])
    assert time.monotonic() - gone >= 1.0 + ADMIT_LINGER_S - 0.3  # not before its patience ran out
    del prefixed


def test_a_joiner_whose_job_ends_before_admitting_it_gets_a_clear_error_and_exit_code(monkeypatch, capsys):
    import gc

    from islands import cli_more
    from islands.cli import main
    from islands.runtime.elastic import JobEnded
    from islands.runtime.elastic.membership import JOB_ENDED_EXIT_CODE

    server, prefixed = host_store(0)
    comm = elastic_member(connect("127.0.0.1", server.port), "j1", CommLedger())
    outcome: list[BaseException] = []

    def joiner():
        try:
            comm.enter(object(), None)  # a joiner: waits in its strategy's wrap for a round boundary
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    thread = threading.Thread(target=joiner, daemon=True)
    thread.start()
    probe = connect("127.0.0.1", server.port)
    deadline = time.monotonic() + 20
    while not probe.check(["ready/j1"]):  # the joiner waits for admission now
        assert time.monotonic() < deadline
        time.sleep(0.01)
    del probe, prefixed, server  # the job ends: its launcher's store goes away
    gc.collect()
    thread.join(30)
    assert not thread.is_alive() and len(outcome) == 1 and isinstance(outcome[0], JobEnded), outcome
    assert "ended before admitting this worker" in str(outcome[0])

    def ended(*args, **kwargs):
        raise outcome[0]

    monkeypatch.setattr(cli_more, "run_elastic_worker", ended)  # the name `islands join` calls
    live, live_store = host_store(0)  # `islands join` reads what the job runs first: an `islands train` job
    Coordinator(live_store, "t", JobSpec(workers=1, config={}), log=lambda _: None)
    with pytest.raises(SystemExit) as exited:
        main(["join", f"127.0.0.1:{live.port}", "--token", "t", "--name", "j1"])
    assert exited.value.code == JOB_ENDED_EXIT_CODE
    assert f"127.0.0.1:{live.port}: the job ended before admitting this worker" in capsys.readouterr().out


def test_joining_an_address_where_nothing_listens_is_one_clear_line(capsys):
    from islands.cli import main
    from islands.runtime.elastic.membership import JOB_ENDED_EXIT_CODE
    from islands.runtime.launch.ranks import free_port

    port = free_port()  # nothing listens there
    with pytest.raises(SystemExit) as exited:
        main(["join", f"127.0.0.1:{port}", "--token", "t", "--name", "j1"])
    assert exited.value.code == JOB_ENDED_EXIT_CODE
    captured = capsys.readouterr()
    assert (
        f"no elastic job answers at 127.0.0.1:{port}" in captured.out and "address its launcher printed" in captured.out
    )
    assert "Traceback" not in captured.out + captured.err


def test_a_member_cut_off_after_registering_does_not_hold_the_new_epochs_connect():
    # chaos, session 17: a join's new epoch listed a leader whose link was cut just after it registered; the
    # others sat in gloo's connect (timeout 4 x heartbeat + 5 s) until it failed, a 4.5 s stall. The connect
    # is now watched like a collective, so the silent member is dropped once its heartbeat is stale.
    from islands.runtime.elastic.membership import Heartbeat

    timeout = 2.0
    connect_timeout = 4 * timeout + 5  # Epochs._build's, with collective_timeout above it
    server, prefixed = host_store(0)
    store = connect("127.0.0.1", server.port)
    candidates = [[0, "w0", 0], [1, "w1", 1], [2, "w2", 2]]
    store.set("e/1/reg/w2", "1")  # w2 registered, then went silent: it never beats nor connects
    beats = [Heartbeat("127.0.0.1", server.port, n) for n in ("w0", "w1")]
    out, errors = {}, []

    def member(name):
        try:
            member = elastic_member(
                connect("127.0.0.1", server.port),
                name,
                CommLedger(),
                heartbeat_timeout=timeout,
                collective_timeout=60.0,
                new_client=lambda: connect("127.0.0.1", server.port),
            )
            start = time.monotonic()
            member.epochs.form(1, candidates)
            out[name] = (time.monotonic() - start, member.epoch, list(member.names))
            member.comm.all_reduce(torch.ones(1))  # the group formed without w2 works
            member.leave()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((name, e))

    threads = [threading.Thread(target=member, args=(n,)) for n in ("w0", "w1")]
    [t.start() for t in threads]
    [t.join(90) for t in threads]
    [b.stop() for b in beats]
    assert not errors, errors
    for name in ("w0", "w1"):
        seconds, epoch, names = out[name]
        assert epoch == 2 and names == ["w0", "w1"], out[name]
        assert seconds < connect_timeout - 3, f"{name} waited {seconds:.1f} s: the connect was not abandoned"
    del prefixed
