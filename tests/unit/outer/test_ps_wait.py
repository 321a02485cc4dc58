"""A parameter server window that waits for its quorum (issue #36, setting (a)): with `wait` > 0 a push short of its
window's quorum is answered only once the window steps, or steps the window without the rest after `wait` seconds;
and plain SGD's lr is each push's, so a window of k pushes steps k times its mean. Equal islands then train as
synchronous DiLoCo does; a slow island is not waited for beyond `wait`. The loop in thread mode (virtual and real
clocks), the shard servers of process mode (as threads here), and the strategy under islands.simulate."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_ps_service import config, push
from test_ps_strategy import Island

import islands
from harness.ps import ThreadService
from islands.outer import DiLoCo, FirstCome, InProcessServer, OuterSGD, ParameterServer, VirtualClock
from islands.sync.outer.ps import OuterRule
from islands.sync.outer.ps_link import DONE, PUSH, LocalInbox, LocalLink, Message, ServerLoop
from islands.sync.outer.ps_server import Contribution, ServerState
from islands.sync.outer.ps_wire import PULL


def vec(x: float) -> torch.Tensor:
    return torch.full((3,), x)


@pytest.mark.parametrize("per_push, moved", [(True, -8.0), (False, -4.0)])
def test_a_window_of_k_pushes_steps_k_times_its_mean_when_the_lr_is_per_push(per_push, moved):
    # lr 2 on deltas 1 and 3 (mean 2): per push, the two pushes' own steps (2 x 1 + 2 x 3 = 8); else one step (4)
    s = ServerState(vec(0.0), lambda: OuterSGD(2.0), quorum=2, per_push=per_push)
    assert not s.push(Contribution(0, 0, vec(1.0))).stepped
    assert s.push(Contribution(1, 0, vec(3.0))).stepped
    assert torch.equal(s.pull()[1], vec(moved))


class Islands:
    """Islands as threads of this process, each pushing a fixed delta every round through a LocalLink to one
    ServerLoop (global -= delta per push: SGD lr 1, per push), keeping every answer."""

    def __init__(self, arrivals, deltas: list[float], rounds: int, wait: float, quorum: int = 2):
        state = ServerState(vec(0.0), lambda: OuterSGD(1.0), quorum=quorum, max_staleness=50, per_push=True)
        self.inbox = LocalInbox()
        self.loop = ServerLoop(state, len(deltas), arrivals, self.inbox, wait=wait)
        self.answers: list[list] = [[] for _ in deltas]
        self.threads = [
            threading.Thread(target=self.island, args=(i, d, rounds), daemon=True) for i, d in enumerate(deltas)
        ]

    def island(self, i: int, delta: float, rounds: int) -> None:
        link, version = LocalLink(self.inbox, timeout_s=60.0), 0
        for _ in range(rounds):
            reply = link.send(Message(PUSH, i, version, 1.0, vec(delta)))
            self.answers[i].append((reply.ack, time.monotonic(), reply.flat[0].item()))
            version = reply.ack.version
        link.send(Message(DONE, i))

    def run(self) -> Islands:
        self.loop.start()
        for t in self.threads:
            t.start()
        for t in self.threads:
            t.join(60)
        self.loop.join(60)
        return self


def test_equal_islands_wait_for_each_other_and_every_push_is_fresh():
    # two islands of equal rounds: every window holds both pushes, island 0's answer waits for island 1's push,
    # and each island starts every round from the model its own push is in (staleness 0, the versions in step)
    run = Islands(VirtualClock([1.0, 1.0]), [1.0, 3.0], rounds=3, wait=0.5).run()
    for answers in run.answers:
        got = [(a.version, a.staleness, a.stepped) for a, _, _ in answers]
        assert got == [(1, 0, True), (2, 0, True), (3, 0, True)]
        assert [x for _, _, x in answers] == [-4.0, -8.0, -12.0]
    assert run.loop.arrivals.waited == [0.0, 0.0]  # both came at the same virtual time: no one waited


def test_without_a_wait_the_island_short_of_the_quorum_trains_on_a_stale_model():
    run = Islands(VirtualClock([1.0, 1.0]), [1.0, 3.0], rounds=3, wait=0.0).run()
    first = [(a.version, a.stepped) for a, _, _ in run.answers[0]]
    assert first[0] == (0, False)  # answered before the window stepped: without its own push
    assert [a.staleness for a, _, _ in run.answers[0]][1:] == [1, 1]  # so each later push is one version old


def test_a_slow_island_is_waited_for_no_longer_than_wait_on_the_virtual_clock():
    # island 1's rounds take 4x as long: each of island 0's windows steps alone once its 0.25 s have passed, and
    # island 0's next push comes that much later; the same schedule twice gives the same answers
    runs = [Islands(VirtualClock([1.0, 4.0]), [1.0, 3.0], rounds=3, wait=0.25).run() for _ in range(2)]
    a, b = ([[(ack, x) for ack, _, x in answers] for answers in run.answers] for run in runs)
    assert a == b
    island0 = a[0]
    assert [ack.version for ack, _ in island0] == [1, 2, 3] and all(ack.stepped for ack, _ in island0)
    assert [x for _, x in island0] == [-1.0, -2.0, -3.0]  # each window held island 0's push alone
    assert runs[0].loop.arrivals.waited[0] == pytest.approx(0.75)  # three pushes, each waited out its 0.25 s
    assert runs[0].loop.state.counts["refused"] == 0 and runs[0].loop.state.pull()[1][0].item() == -12.0


def test_a_slow_island_is_waited_for_no_longer_than_wait_in_real_time():
    inbox = LocalInbox()
    state = ServerState(vec(0.0), lambda: OuterSGD(1.0), quorum=2, per_push=True)
    loop = ServerLoop(state, 2, FirstCome(), inbox, wait=0.3)
    loop.start()
    fast, slow = LocalLink(inbox, timeout_s=60.0), LocalLink(inbox, timeout_s=60.0)
    t0 = time.monotonic()
    reply = fast.send(Message(PUSH, 0, 0, 1.0, vec(1.0)))  # island 1 does not push for a while
    held = time.monotonic() - t0
    assert 0.3 <= held < 5.0 and reply.ack.stepped and reply.ack.version == 1 and reply.flat[0].item() == -1.0
    done = threading.Thread(target=lambda: fast.send(Message(DONE, 0)))  # answered once every island is done
    done.start()  # island 1's push then steps alone: at once once island 0's DONE is in, else after the wait
    late = slow.send(Message(PUSH, 1, 0, 1.0, vec(3.0)))
    assert late.ack.accepted and late.ack.staleness == 1 and late.ack.stepped and late.flat[0].item() == -4.0
    slow.send(Message(DONE, 1))
    done.join(60)
    loop.join(60)


def test_a_push_still_crossing_a_slow_link_at_the_deadline_is_waited_for():
    # island 1's push has begun to arrive (its header is in, as GlooReceiver marks it) when island 0's window would
    # step: a slow link's transfer is not a late island, so the window waits and steps with both pushes
    inbox = LocalInbox()
    state = ServerState(vec(0.0), lambda: OuterSGD(1.0), quorum=2, per_push=True)
    loop = ServerLoop(state, 2, FirstCome(), inbox, wait=0.1)
    loop.start()
    inbox.begin(1)
    got: dict = {}
    first = threading.Thread(target=lambda: got.update(a=LocalLink(inbox).send(Message(PUSH, 0, 0, 1.0, vec(1.0)))))
    first.start()
    first.join(0.6)
    assert first.is_alive()  # six deadlines later, still held for island 1's push
    second = LocalLink(inbox).send(Message(PUSH, 1, 0, 1.0, vec(3.0)))  # its payload lands: one window of both
    first.join(30)
    assert got["a"].ack.version == second.ack.version == 1 and got["a"].flat[0].item() == -4.0
    done = [threading.Thread(target=LocalLink(inbox).send, args=(Message(DONE, i),)) for i in (0, 1)]
    for t in done:
        t.start()
    for t in done:
        t.join(30)
    loop.join(30)


def test_shard_servers_hold_a_push_for_its_window_then_step_without_the_rest(tmp_path):
    with ThreadService(tmp_path, config(quorum=2, islands=2, wait=0.4, servers=2, per_push=True)) as service:
        a, b = service.link(0), service.link(1)
        for x in (a, b):  # both join: the quorum counts islands that have joined
            x.send(Message(PULL, x.island))
        got: dict = {}
        waiting = threading.Thread(target=lambda: got.update(a=push(a, 1.0)))
        waiting.start()
        time.sleep(0.1)
        both = push(b, 3.0)  # completes the window: both answered with the step of both pushes
        waiting.join(30)
        assert both.ack.stepped and got["a"].ack.stepped and got["a"].ack.version == both.ack.version == 1
        assert torch.equal(got["a"].flat, torch.full((10,), -4.0)) and torch.equal(both.flat, got["a"].flat)
        t0 = time.monotonic()
        alone = push(a, 1.0)  # nobody else comes: after the wait the window steps with a's push alone
        assert time.monotonic() - t0 >= 0.4 and alone.ack.stepped and alone.ack.version == 2
        assert torch.equal(alone.flat, torch.full((10,), -5.0))
        for server in service.servers:  # each server timed its own window, journaled as a settle
            assert server.durable.state.version == 2


def test_shard_servers_wait_past_the_deadline_for_a_push_still_crossing_a_slow_link(tmp_path):
    # process mode's rule as thread mode's (test_a_push_still_crossing_a_slow_link_at_the_deadline_is_waited_for):
    # island 1's push has its header in on every shard (Members.begin, as the connection marks it) when island 0's
    # window would step, so the window waits; once it lands, one window of both
    with ThreadService(tmp_path, config(quorum=2, islands=2, wait=0.1, servers=2, per_push=True)) as service:
        a, b = service.link(0), service.link(1)
        for x in (a, b):
            x.send(Message(PULL, x.island))
        for server in service.servers:
            with server.lock:
                server.members.begin(1)
        got: dict = {}
        waiting = threading.Thread(target=lambda: got.update(a=push(a, 1.0)))
        waiting.start()
        waiting.join(0.8)
        assert waiting.is_alive()  # eight deadlines later, still held for island 1's push
        both = push(b, 3.0)  # island 1's push lands: one window of both
        waiting.join(30)
        for server in service.servers:  # the marks made by hand above, cleared as a connection clears its own
            with server.lock:
                server.members.landed(1)
                server.members.end(1)
        assert got["a"].ack.version == both.ack.version == 1
        assert torch.equal(got["a"].flat, torch.full((10,), -4.0))
        t0 = time.monotonic()
        alone = push(a, 1.0)  # nothing on its way in any more: the next window steps at its deadline
        assert time.monotonic() - t0 < 5.0 and alone.ack.version == 2


@pytest.mark.parametrize("m", [2, 3])
def test_equal_simulated_islands_with_a_held_window_end_on_synchronous_dilocos_model(m):
    """For any M: a full window's default step is DiLoCo's sqrt(2) on the mean (ps.WINDOWED_LR; before session 38
    M = 3 moved sqrt(3) x the mean, 1/sqrt(M) per push, and ended elsewhere)."""
    torch.set_num_threads(1)

    def run(make):
        server = InProcessServer()

        def main(world):
            isl = Island(world, make(server), inner="sgd")
            for i in range(6):
                isl.step(i)
            isl.strategy.finish(isl.model)
            return isl.strategy.global_flat.clone()

        return islands.simulate.run(main, islands=m)

    clock = lambda: VirtualClock([1.0] * m)  # noqa: E731
    held = run(lambda s: ParameterServer(inner_steps=2, quorum=m, wait=0.5, arrivals=clock(), host=s))
    sync = run(lambda s: DiLoCo(inner_steps=2))  # plain SGD, lr sqrt(2) on the mean: the default of both
    stale = run(lambda s: ParameterServer(inner_steps=2, quorum=m, arrivals=clock(), host=s))
    torch.testing.assert_close(held[0], sync[0], rtol=1e-5, atol=1e-6)
    assert all(torch.equal(held[0], h) for h in held[1:]) and not torch.allclose(
        stale[0], sync[0], rtol=1e-5, atol=1e-6
    )


def test_a_waiting_servers_default_step_is_dilocos_over_a_full_window_and_a_chosen_lr_is_kept():
    def lr(strategy: ParameterServer, islands: int) -> float:
        assert isinstance(strategy.rule, OuterRule)
        return strategy.rule.lr_for(islands)

    sqrt2 = 2**0.5
    assert lr(ParameterServer(4, quorum=3, wait="auto"), 3) == pytest.approx(sqrt2 / 3)
    assert lr(ParameterServer(4, quorum=3, wait=1.0), 2) == pytest.approx(sqrt2 / 2)  # quorum <= the islands
    assert lr(ParameterServer(4, quorum=3), 3) == pytest.approx(3**-0.5)  # no wait: asynchronous pushes
    assert lr(ParameterServer(4), 4) == pytest.approx(0.5)
    assert lr(ParameterServer(4, rule=OuterRule("sgd", lr=0.3), quorum=3, wait="auto"), 3) == 0.3
    assert lr(ParameterServer(4, rule=OuterRule("delayed-nesterov"), quorum=3, wait="auto"), 3) == 0.7
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        OuterRule("sgd").windowed(0)


@pytest.mark.parametrize(
    "spec, needle",
    [("ps:inner_steps=4,wait=1", "quorum >= 2"), ("ps:inner_steps=4,quorum=2,wait=-1", "wait must be >= 0")],
)
def test_a_wait_without_a_quorum_or_below_zero_is_refused(spec, needle):
    from islands.sync.outer import make_outer

    with pytest.raises(ValueError, match=needle):
        make_outer(spec)
