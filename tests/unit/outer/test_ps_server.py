"""The parameter server's numerics in one process (issue #36): delayed Nesterov against a hand computation, the
staleness rules, samples-weighted windows, quorum, robust windows, shards, and state round trips."""

from __future__ import annotations

import threading

import pytest
import torch

from islands.aggregate import CoordinateMedian
from islands.outer import DelayedNesterov, OuterSGD, VirtualClock
from islands.sync.outer.ps_link import DONE, PUSH, LocalInbox, LocalLink, Message, ServerLoop
from islands.sync.outer.ps_server import Contribution, ServerState


def vec(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def test_delayed_nesterov_matches_a_hand_computation():
    # lr 0.5, momentum 0.9, N = 2, on a 2-vector; the hand computation uses Python floats, not the class
    lr, beta, n = 0.5, 0.9, 2
    opt = DelayedNesterov(lr, beta, buffer=n)
    p = vec(1.0, -2.0)
    pushes = [(0.2, -0.4), (0.6, 0.0), (-0.2, 0.8), (0.4, 0.4)]
    x, m, acc = [1.0, -2.0], [0.0, 0.0], [0.0, 0.0]
    for k, g in enumerate(pushes, start=1):
        opt.step(p, vec(*g))
        for i in range(2):
            x[i] -= lr * g[i] / n
            acc[i] += g[i]
        if k % n == 0:
            for i in range(2):
                m[i] = beta * m[i] + acc[i] / n
                x[i] -= lr * beta * m[i]
            acc = [0.0, 0.0]
        assert p.tolist() == pytest.approx(x, abs=1e-6), f"after push {k}"
    # the momentum after two milestones: 0.9 * mean(g1, g2) + mean(g3, g4)
    assert opt.m is not None
    assert opt.m.tolist() == pytest.approx([0.9 * 0.4 + 0.1, 0.9 * -0.2 + 0.6], abs=1e-6)


def test_delayed_nesterov_over_n_pushes_is_one_nesterov_step_on_their_mean():
    torch.manual_seed(0)
    gs = [torch.randn(5) for _ in range(6)]
    dn, ref = DelayedNesterov(0.7, 0.9, buffer=3), OuterSGD(0.7, 0.9, nesterov=True)
    p, q = torch.zeros(5), torch.zeros(5)
    for k, g in enumerate(gs, start=1):
        dn.step(p, g)
        if k % 3 == 0:
            ref.step(q, torch.stack(gs[k - 3 : k]).mean(0))
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    # between milestones the model still moves (by the pushed gradient only)
    before = p.clone()
    dn.step(p, gs[0])
    torch.testing.assert_close(p, before - 0.7 * gs[0] / 3, rtol=0, atol=1e-6)


def sgd_state(initial, **kw) -> ServerState:
    return ServerState(initial, lambda: OuterSGD(1.0), **kw)


def test_stale_contributions_are_refused_and_change_nothing():
    s = sgd_state(vec(0.0, 0.0), max_staleness=1)
    assert s.push(Contribution(0, 0, vec(1.0, 0.0))).accepted  # version 0 -> 1
    ack = s.push(Contribution(1, 0, vec(0.0, 1.0)))  # staleness 1 = max: accepted
    assert ack.accepted and ack.staleness == 1 and s.version == 2
    version, before = s.pull()
    ack = s.push(Contribution(2, 0, vec(5.0, 5.0), samples=7))  # staleness 2 > 1: refused
    assert not ack.accepted and ack.staleness == 2 and ack.version == version
    assert torch.equal(s.pull()[1], before) and s.version == version
    assert not s.push(Contribution(2, version + 1, vec(1.0, 1.0))).accepted  # a version never issued
    assert s.counts["refused"] == 2
    assert s.goodput() == pytest.approx(2 / (2 + 7 + 1))
    torch.testing.assert_close(before, vec(-1.0, -1.0))  # global - delta with lr 1


def test_a_window_is_merged_weighted_by_samples_in_arrival_order():
    s = sgd_state(vec(0.0, 0.0), quorum=2)
    ack = s.push(Contribution(0, 0, vec(4.0, 0.0), samples=1))
    assert ack.accepted and not ack.stepped and s.version == 0
    assert not s.push(Contribution(0, 0, vec(4.0, 0.0), samples=1)).stepped  # same island again: no quorum yet
    ack = s.push(Contribution(1, 0, vec(0.0, 4.0), samples=2))
    assert ack.stepped and s.version == 1
    # (1*[4,0] + 1*[4,0] + 2*[0,4]) / 4
    torch.testing.assert_close(s.pull()[1], vec(-2.0, -2.0))


def test_discount_shrinks_stale_windows():
    s = sgd_state(vec(0.0), discount=1.0, max_staleness=3)
    s.push(Contribution(0, 0, vec(1.0)))  # fresh: weight 1, factor 1 -> -1
    s.push(Contribution(1, 0, vec(1.0)))  # staleness 1: weight 1/2, factor 1/2 -> -1.5
    torch.testing.assert_close(s.pull()[1], vec(-1.5))


def test_a_robust_window_drops_the_outlier():
    s = ServerState(vec(0.0, 0.0), lambda: OuterSGD(1.0), quorum=3, aggregator=CoordinateMedian())
    for island, d in enumerate([vec(1.0, 1.0), vec(100.0, -100.0), vec(2.0, 3.0)]):
        ack = s.push(Contribution(island, 0, d, samples=10))
    assert ack.stepped
    torch.testing.assert_close(s.pull()[1], vec(-2.0, -1.0))


def test_shards_split_by_parameter_range_give_the_one_shard_result():
    torch.manual_seed(1)
    init = torch.randn(11)
    pushes = [Contribution(i % 3, v, torch.randn(11), samples=1 + i) for i, v in enumerate([0, 0, 1, 2, 2, 4])]
    out = []
    for shards in (1, 3):
        s = ServerState(init, lambda: DelayedNesterov(0.7, 0.9, buffer=2), shards=shards, max_staleness=2)
        acks = [s.push(c) for c in pushes]
        out.append((s.pull()[1], [a.accepted for a in acks]))
        assert len(s.rules) == shards and [hi - lo for lo, hi in s.bounds] == ([11] if shards == 1 else [4, 4, 3])
    assert out[0][1] == out[1][1]
    torch.testing.assert_close(out[0][0], out[1][0], rtol=0, atol=0)


def test_state_round_trip_continues_exactly():
    torch.manual_seed(2)
    init = torch.randn(6)
    pushes = [Contribution(i % 2, max(0, i - 1), torch.randn(6), samples=1 + i % 3) for i in range(8)]

    def build():
        return ServerState(init, lambda: DelayedNesterov(0.5, 0.9, buffer=3), shards=2, quorum=2)

    whole = build()
    for c in pushes:
        whole.push(c)
    first = build()
    for c in pushes[:3]:  # stops mid-window and mid-buffer
        first.push(c)
    resumed = build()
    resumed.load_state_dict(first.state_dict())
    for c in pushes[3:]:
        resumed.push(c)
    assert resumed.version == whole.version and resumed.counts == whole.counts
    torch.testing.assert_close(resumed.pull()[1], whole.pull()[1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="shards"):
        ServerState(init, lambda: OuterSGD(1.0), shards=3).load_state_dict(first.state_dict())


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"shards": 0}, "shards"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"quorum": 0}, "quorum"),
        ({"discount": -0.5}, "discount"),
    ],
)
def test_bad_server_options_name_themselves(kw, words):
    with pytest.raises(ValueError, match=words):
        sgd_state(vec(0.0), **kw)


def test_the_loop_applies_pushes_in_virtual_clock_order_whatever_the_real_order():
    order: list[int] = []

    class Recording(ServerState):
        def push(self, c, active=None):
            order.append(c.island)
            return super().push(c, active)

    state = Recording(vec(0.0), lambda: OuterSGD(1.0), max_staleness=10)
    inbox = LocalInbox()
    loop = ServerLoop(state, 2, VirtualClock([3.0, 1.0]), inbox)  # island 1 is 3x faster
    loop.start()
    replies: dict[int, list] = {0: [], 1: []}

    def island(i: int, rounds: int) -> None:
        link = LocalLink(inbox)
        for _ in range(rounds):
            replies[i].append(link.send(Message(PUSH, i, 0, 1.0, vec(1.0))))
        replies[i].append(link.send(Message(DONE, i)))

    threads = [threading.Thread(target=island, args=(i, r)) for i, r in ((0, 2), (1, 4))]
    for t in reversed(threads):  # the slow island starts first in real time
        t.start()
    for t in threads:
        t.join(timeout=30)
    loop.join(timeout=30)
    # virtual times: island 1 at 1, 2, 3(tie: island 0 first), 4; island 0 at 3, 6; DONEs at 5 (1) and 9 (0)
    assert order == [1, 1, 0, 1, 1, 0]
    final = replies[0][-1].flat
    assert torch.equal(final, replies[1][-1].flat) and final.item() == -6.0


def test_a_failing_server_fails_the_waiting_island_instead_of_hanging():
    inbox = LocalInbox()
    loop = ServerLoop(sgd_state(vec(0.0, 0.0)), 1, VirtualClock([1.0]), inbox)
    loop.start()
    with pytest.raises(RuntimeError, match="a push of 3 values to a server of 2"):
        LocalLink(inbox).send(Message(PUSH, 0, 0, 1.0, vec(1.0, 2.0, 3.0)))
    with pytest.raises(RuntimeError, match="parameter server loop failed"):
        loop.join(timeout=10)


def test_a_sealed_message_altered_on_the_way_is_refused():
    from islands.runtime.elastic.auth import derive_key
    from islands.runtime.payload_auth import PayloadAuthError, PayloadTags
    from islands.sync.outer.ps_link import Sealer

    sealer = Sealer(PayloadTags(derive_key("secret", "payload|test"), b"test|"))
    delta = vec(1.0, 2.0, 3.0)
    packed = sealer.tags.pack(delta, ("ps_payload", 1, 0, 4))
    assert torch.equal(sealer.open(packed.clone(), delta, ("ps_payload", 1, 0, 4)), delta)
    tampered = packed.clone()
    tampered[0] ^= 1
    for bad, fields in (
        (tampered, ("ps_payload", 1, 0, 4)),
        (packed, ("ps_payload", 1, 0, 5)),
        (packed, ("ps_payload", 2, 0, 4)),
    ):
        with pytest.raises(PayloadAuthError, match="failed its MAC"):
            sealer.open(bad.clone(), delta, fields)  # altered, replayed as another message, relabelled sender


def test_the_thread_mode_wait_for_an_answer_is_bounded():
    # two islands, one never comes: the other's DONE (answered when every island is done) times out instead of hanging
    inbox = LocalInbox()
    loop = ServerLoop(sgd_state(vec(0.0)), 2, VirtualClock([1.0, 1.0]), inbox)
    loop.start()
    with pytest.raises(TimeoutError, match="within 1 s"):
        LocalLink(inbox, timeout_s=1.0).send(Message(DONE, 0))
    assert LocalLink(inbox, timeout_s=30.0).send(Message(DONE, 1)).ack.accepted  # the other comes: the loop ends
    loop.join(timeout=30)
    assert not loop.thread.is_alive()
