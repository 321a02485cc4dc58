"""The ParameterServer outer strategy in one process (issue #36): one island against DiLoCo's Nesterov step, resume
from a state_dict, islands.simulate with a virtual clock (deterministic, uneven speeds), and bad specs exit 2."""

from __future__ import annotations

import copy

import pytest
import torch

import islands
from harness.cli import islands_cli
from harness.outer import batch, tiny_model
from islands.models import sequence_loss
from islands.outer import DiLoCo, InProcessServer, OuterSGD, ParameterServer, VirtualClock
from islands.runtime.world import World
from islands.sync.outer.ps import outer_rule


class Island:
    """A tiny byte LM, AdamW and one outer strategy, stepped by hand in the trainer's hook order."""

    def __init__(self, world, strategy, inner: str = "adamw"):
        torch.manual_seed(0)
        self.world, self.model = world, tiny_model()
        params = self.model.parameters()
        # plain SGD where two runs differ in fp32 rounding only: Adam's 1/sqrt(v) would blow an ulp up to lr size
        self.opt = torch.optim.SGD(params, lr=0.1) if inner == "sgd" else torch.optim.AdamW(params, lr=1e-2)
        self.strategy = strategy
        strategy.wrap(self.model, self.opt, world)

    def step(self, i: int) -> None:
        b = batch(self.world.rank, i)
        sequence_loss(self.model(b[:, :-1]), b[:, 1:]).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.strategy.after_step(self.model, self.opt, i)


def test_one_island_with_buffer_one_is_diloco_with_nesterov():
    # delayed Nesterov with N = 1 is Nesterov at every push: one island's ps run is DiLoCo with OuterSGD(0.7, 0.9)
    rule = outer_rule("delayed-nesterov", 0.7, 0.9, 1)
    ps = Island(World.single(), ParameterServer(inner_steps=3, rule=rule), inner="sgd")
    dl = Island(World.single(), DiLoCo(inner_steps=3, outer_optimizer=OuterSGD(0.7, 0.9, nesterov=True)), inner="sgd")
    for i in range(7):
        ps.step(i)
        dl.step(i)
    ps.strategy.finish(ps.model)
    dl.strategy.finish(dl.model)
    assert ps.strategy.version == 3 and ps.strategy.counts == {"pushes": 3, "refused": 0}  # 3 + 3 + the last 1
    torch.testing.assert_close(ps.strategy.global_flat, dl.strategy.global_flat, rtol=0, atol=1e-6)
    assert not torch.equal(ps.strategy.global_flat, Island(World.single(), DiLoCo(3)).strategy.global_flat)


def test_resume_from_the_state_dict_continues_exactly():
    def make():
        return Island(World.single(), ParameterServer(inner_steps=2, shards=2))

    whole = make()
    for i in range(9):
        whole.step(i)
    whole.strategy.finish(whole.model)

    first = make()
    for i in range(5):  # stops mid-round
        first.step(i)
    saved = copy.deepcopy(
        {"model": first.model.state_dict(), "opt": first.opt.state_dict(), "ps": first.strategy.state_dict()}
    )
    assert saved["ps"]["ps_server"]["version"] == 2
    second = make()
    second.model.load_state_dict(saved["model"])
    second.opt.load_state_dict(saved["opt"])
    second.strategy.load_state_dict(saved["ps"])
    for i in range(5, 9):
        second.step(i)
    second.strategy.finish(second.model)
    assert second.strategy.version == whole.strategy.version == 5
    torch.testing.assert_close(second.strategy.global_flat, whole.strategy.global_flat, rtol=0, atol=0)


def simulated(round_seconds, steps: int = 8, h: int = 2, **kw):
    server = InProcessServer()

    def main(world):
        strategy = ParameterServer(
            inner_steps=h, arrivals=VirtualClock(round_seconds), host=server, max_staleness=2, **kw
        )
        isl = Island(world, strategy)
        for i in range(steps):
            isl.step(i)
        strategy.finish(isl.model)
        return strategy.global_flat.clone(), dict(strategy.counts), strategy.version

    results = islands.simulate.run(main, islands=len(round_seconds))
    assert server.loop is not None
    return results, server.loop.state


def test_simulated_islands_of_uneven_speed_are_deterministic_and_end_on_one_model():
    torch.set_num_threads(1)
    (a, state), (b, _) = simulated([1.0, 4.0]), simulated([1.0, 4.0])
    for (fa, ca, va), (fb, cb, vb) in zip(a, b):
        assert torch.equal(fa, fb) and ca == cb and va == vb
    assert torch.equal(a[0][0], a[1][0])  # every island ends on the final global model
    # equal compute (4 rounds each); island 1's rounds take 4x as long in virtual time, so island 0's pushes all
    # land before island 1's second: island 1's later pushes are 3-4 versions stale, past max_staleness=2
    assert a[0][1] == {"pushes": 4, "refused": 0}
    assert a[1][1]["pushes"] == 4 and a[1][1]["refused"] >= 1
    assert state.counts["refused"] == a[1][1]["refused"] and 0 < state.goodput() < 1


def test_a_quorum_of_both_islands_makes_it_semi_synchronous():
    torch.set_num_threads(1)
    results, state = simulated([1.0, 1.0], quorum=2)
    assert state.version == 4 and state.counts["steps"] == 4 and state.counts["refused"] == 0


def test_bad_ps_specs_exit_2_with_the_choices(capsys):
    code = islands_cli("train", "--workers", "2", "--islands", "2", "--outer", "ps:inner_steps=4,outer=adam")
    assert code == 2
    err = capsys.readouterr().err
    assert "delayed-nesterov, nesterov, sgd" in err and "Traceback" not in err
    assert islands_cli("train", "--workers", "2", "--islands", "2", "--outer", "ps:inner_steps=4,quorum=0") == 2
    assert "quorum" in capsys.readouterr().err


def test_simulated_islands_need_one_shared_server():
    def main(world):
        Island(world, ParameterServer(inner_steps=2))

    with pytest.raises(RuntimeError, match="InProcessServer"):
        islands.simulate.run(main, islands=2)


def test_simulate_from_the_cli_refuses_ps_with_the_python_way(capsys):
    argv = ["train", "--workers", "2", "--islands", "2", "--simulate", "--outer", "ps:inner_steps=4"]
    assert islands_cli(*argv) == 2
    assert "host=InProcessServer()" in capsys.readouterr().err


def test_the_default_server_step_is_dilocos_spread_over_the_pushes_and_delayed_nesterov_is_a_choice():
    """Default (DEFAULT_PS_RULE): plain SGD, lr 1/sqrt(M) per push, no momentum (the parameter-server bench found it
    reached DDP's loss where delayed Nesterov did not); an explicit lr or momentum is kept; delayed-nesterov keeps
    2401.09135's 0.7/0.9 with N = the island count."""
    from islands.outer import DelayedNesterov
    from islands.sync.outer import make_outer

    default = outer_rule()(4)
    assert isinstance(default, OuterSGD) and (default.lr, default.momentum, default.nesterov) == (0.5, 0.0, False)
    assert ParameterServer(2).rule(9).lr == pytest.approx(1 / 3)
    chosen = outer_rule("sgd", lr=0.3, momentum=0.5)(4)
    assert (chosen.lr, chosen.momentum) == (0.3, 0.5)
    delayed = outer_rule("delayed-nesterov")(3)
    assert isinstance(delayed, DelayedNesterov) and (delayed.lr, delayed.momentum, delayed.buffer) == (0.7, 0.9, 3)
    # the spec at the edge: `ps:inner_steps=H` builds the same default, outer= still names the others
    assert make_outer("ps:inner_steps=2").rule(4).lr == 0.5
    assert isinstance(make_outer("ps:inner_steps=2,outer=delayed-nesterov").rule(4), DelayedNesterov)
