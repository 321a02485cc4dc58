"""The parameter server's stale cap (ps_server.StaleCap, `ps:...,stale_cap=true`): the plain SGD step held under
the delayed step's stability limit for the staleness its pushes have had (docs/parameter-server.md, "Where the time goes
under churn"). On a linear model of M equal-speed islands pushing in turn (each push M - 1 versions stale), the
default lr 1/sqrt(M) runs away at M = 4 and the cap brings the model to its optimum; at a mean staleness of at most
1 the default step stays."""

from __future__ import annotations

import math

import pytest
import torch

import islands
from islands.outer import InProcessServer, VirtualClock
from islands.sync.outer import make_outer
from islands.sync.outer.ps import OuterRule, ParameterServer, outer_rule
from islands.sync.outer.ps_server import CAP_EVERY, Contribution, ServerState, StaleCap
from islands.sync.outer.ps_service import ServiceConfig


def round_robin(m: int, scale, pushes: int = 240, c: float = 1.0, quorum: int = 1) -> float:
    """|x| after `pushes` pushes of m islands in turn, each pushing c x (the way to the optimum 0 from the model it
    pulled at its previous push) to a server stepping SGD at lr 1/sqrt(m), one step per `quorum` islands' pushes."""
    state = ServerState(torch.ones(1), lambda: OuterRule("sgd")(m), max_staleness=m, scale=scale, quorum=quorum)
    pulled = [state.pull() for _ in range(m)]  # every island starts from version 0
    for k in range(pushes):
        i = k % m
        version, x = pulled[i]
        ack = state.push(Contribution(i, version, c * x))
        assert ack.accepted and (quorum > 1 or ack.staleness == min(k, m - 1))
        pulled[i] = state.pull()
    return float(state.pull()[1].abs().item())


def test_four_equal_islands_run_away_at_the_default_step_and_settle_under_the_cap():
    # lr 1/sqrt(4) = 0.5 against the 3-stale limit 2 sin(pi/14) = 0.445: the delayed step grows without bound
    assert round_robin(4, None) > 10.0
    assert round_robin(4, StaleCap(OuterRule("sgd").lr_for(4))) < 1e-3


def test_with_a_quorum_the_cap_steps_in_only_where_the_default_is_slow():
    # a window of `quorum` pushes is one step, so pushes are fewer versions stale: 4 islands in pairs are 1-2 stale,
    # within the default's limit, and the cap keeps the default step (the same model); 8 islands in pairs are 3-4
    # stale, where 1/sqrt(8) settles slowly and the cap's smaller step settles far faster; quorum = M is synchronous
    cap = StaleCap(OuterRule("sgd").lr_for(4))
    assert round_robin(4, cap, pushes=480, quorum=2) == round_robin(4, None, pushes=480, quorum=2) < 1e-12
    assert round_robin(4, cap, pushes=480, quorum=4) == round_robin(4, None, pushes=480, quorum=4) < 1e-12
    eight = StaleCap(OuterRule("sgd").lr_for(8))
    assert round_robin(8, eight, pushes=480, quorum=2) < round_robin(8, None, pushes=480, quorum=2) / 100


def test_three_equal_islands_settle_faster_under_the_cap():
    # lr 1/sqrt(3) = 0.577 is 93% of the 2-stale limit 0.618: it settles, slowly (0.94 per round at c = 1)
    slow = round_robin(3, None, pushes=90)
    capped = round_robin(3, StaleCap(3**-0.5), pushes=90)
    assert capped < slow / 100


def test_the_cap_keeps_the_default_step_for_pushes_at_most_one_version_stale():
    for m in (2, 3, 4, 8):
        cap = StaleCap(m**-0.5)
        assert cap([5]) == 1.0 and cap([3, 4]) == 1.0 and cap([0, 7]) == pytest.approx(1.0, abs=1e-9)
        # all pushes s versions stale: the step is 1/sqrt(2) of the limit 2 sin(pi / (2 (2 s + 1)))
        for s in (2, 3, 7):
            hist = [0] * (s + 1)
            hist[s] = 1
            want = min(m**-0.5, 2**-0.5 * 2 * math.sin(math.pi / (4 * s + 2)))
            assert cap(hist) * m**-0.5 == pytest.approx(want, rel=1e-6)


def test_the_limit_of_one_staleness_is_the_closed_form_and_mixed_staleness_is_steadier():
    for s in range(6):
        hist = [0] * 6
        hist[s] = 5
        assert StaleCap.limit_of(hist) == pytest.approx(StaleCap.limit(s), abs=1e-9)
    # uneven islands: mostly fresh pushes and a few stale ones bear a larger step than all pushes 2 versions stale
    assert StaleCap.limit_of([4, 0, 2, 0, 0, 0, 1]) > StaleCap.limit(2)
    assert StaleCap.limit_of([0, 0, 0]) == 2.0  # before any push: the undelayed step's limit


def test_the_step_is_capped_by_the_accepted_pushes_staleness_and_survives_a_state_round_trip():
    lr = 3**-0.5
    state = ServerState(torch.zeros(1), lambda: OuterRule("sgd")(3), max_staleness=4, scale=StaleCap(lr))
    for s in (0, 1, 2, 2, 2):  # zero deltas: they move nothing, only their staleness counts
        state.push(Contribution(s % 3, state.version - s, torch.zeros(1)))
    state.push(Contribution(0, state.version - 9, torch.ones(1)))  # refused (> max_staleness): not counted
    assert state.stale_hist == [1, 1, 3, 0, 0]
    copy = ServerState(torch.zeros(1), lambda: OuterRule("sgd")(3), max_staleness=4, scale=StaleCap(lr))
    copy.load_state_dict(state.state_dict())
    for server in (state, copy):
        server.push(Contribution(1, server.version - 2, torch.ones(1)))  # histogram now [1, 1, 4, 0, 0]
        cap = 2**-0.5 * StaleCap.limit_of([1, 1, 4, 0, 0])
        assert StaleCap.limit(2) < StaleCap.limit_of([1, 1, 4, 0, 0]) < StaleCap.limit(1)
        assert float(server.pull()[1].item()) == pytest.approx(-min(lr, cap))  # SGD: params -= lr * delta
    fresh = ServerState(torch.zeros(1), lambda: OuterRule("sgd")(3), max_staleness=4, scale=StaleCap(lr))
    fresh.push(Contribution(0, 0, torch.ones(1)))  # only fresh pushes: the rule's own step
    assert float(fresh.pull()[1].item()) == pytest.approx(-lr)


def test_it_is_on_by_default_for_plain_sgd_off_for_the_nesterov_rules_and_refused_with_momentum():
    ps = make_outer("ps:inner_steps=4")
    assert isinstance(ps, ParameterServer) and ps.stale_cap
    cap = ps.stale_scale(3)  # what its server_state and ServiceConfig get
    assert isinstance(cap, StaleCap) and cap.lr == pytest.approx(3**-0.5)
    off = make_outer("ps:inner_steps=4,stale_cap=false")
    assert isinstance(off, ParameterServer) and off.stale_scale(3) is None
    assert ParameterServer(4, rule=outer_rule("delayed-nesterov")).stale_scale(3) is None
    assert ParameterServer(4, rule=outer_rule("sgd", momentum=0.9)).stale_scale(3) is None
    assert isinstance(ParameterServer(4, rule=outer_rule("sgd", lr=0.3), stale_cap=True).stale_scale(3), StaleCap)
    with pytest.raises(ValueError, match="plain SGD"):
        ParameterServer(4, rule=outer_rule("delayed-nesterov"), stale_cap=True)
    with pytest.raises(ValueError, match="plain SGD"):
        ParameterServer(4, rule=outer_rule("sgd", momentum=0.9), stale_cap=True)


def test_server_processes_get_the_cap_through_their_configuration(tmp_path):
    config = ServiceConfig(torch.zeros(8), OuterRule("sgd"), islands=3, scale=StaleCap(3**-0.5))
    loaded = ServiceConfig.load(config.save(tmp_path))
    scale = loaded.shard_state(0).scale
    assert isinstance(scale, StaleCap) and scale([0, 0, 1]) == pytest.approx(StaleCap(3**-0.5)([0, 0, 1]))


def test_the_factor_is_computed_at_each_of_the_first_pushes_then_every_cap_every_and_a_copy_resumes_the_schedule():
    calls = []

    def scale(hist) -> float:
        calls.append(sum(hist))
        return 0.5

    def server():
        return ServerState(torch.zeros(1), lambda: OuterRule("sgd")(2), max_staleness=2, scale=scale)

    state = server()
    for _ in range(CAP_EVERY + 40):
        state.push(Contribution(0, state.version, torch.ones(1)))
    assert calls == list(range(1, CAP_EVERY + 1)) + [2 * CAP_EVERY]
    copy = server()
    copy.load_state_dict(state.state_dict())
    calls.clear()
    for s in (state, copy):
        for _ in range(CAP_EVERY):
            s.push(Contribution(0, s.version, torch.ones(1)))
    assert calls == [3 * CAP_EVERY, 3 * CAP_EVERY] and torch.equal(state.pull()[1], copy.pull()[1])


class BNCNN(torch.nn.Module):
    """A model islands did not write: conv + BatchNorm, and a forward that returns (logits, features)."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        features = torch.relu(self.bn(self.conv(x)))
        return self.fc(features.flatten(1)), features


def test_a_users_batchnorm_cnn_on_three_equal_islands_trains_under_the_default_cap_and_ends_on_one_model():
    """Through the public API (islands.simulate, islands.outer): 3 islands of equal virtual speed push 2 versions
    stale, so the default step is capped (factor < 1); every island ends on the server's one global model."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(256, 1, 8, 8, generator=g), torch.randn(64, 10, generator=g)
    y = (x.flatten(1) @ w).argmax(1)
    server = InProcessServer()

    def main(world):
        torch.manual_seed(0)
        model = BNCNN()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ps = ParameterServer(inner_steps=5, arrivals=VirtualClock([1.0, 1.0, 1.0]), host=server, max_staleness=4)
        ps.wrap(model, opt, world)
        for i in range(40):
            idx = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(3 * i + world.rank))
            torch.nn.functional.cross_entropy(model(x[idx])[0], y[idx]).backward()
            opt.step()
            opt.zero_grad()
            ps.after_step(model, opt, i)
        ps.finish(model)
        model.eval()
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(model(x)[0], y).item()
        return loss, ps.global_flat.clone(), {k: v.clone() for k, v in model.state_dict().items()}

    torch.set_num_threads(1)
    results = islands.simulate.run(main, islands=3)
    state = server.loop.state
    assert state.stale_hist[2] > state.stale_hist[0] + state.stale_hist[1]  # most pushes 2 versions stale
    assert state.cap["factor"] < 1.0  # so the default step was capped
    assert all(torch.equal(results[0][1], flat) for _, flat, _ in results)  # one global model
    # ... buffers included: each island's running statistics were its own all run, and the job's end averaged them
    # (num_batches_tracked: the largest count); before, every island kept its own
    states = [state for _, _, state in results]
    assert all(torch.equal(states[0][k], other[k]) for other in states[1:] for k in states[0])
    assert states[0]["bn.running_var"].ne(1.0).all() and states[0]["bn.num_batches_tracked"].item() == 40
    assert all(loss < 0.7 * math.log(10) for loss, _, _ in results)  # learnt: chance is ln 10
