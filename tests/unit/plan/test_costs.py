"""Step time from the pieces: per-round costs (the outer strategy's local work, its exchange over the link, the wait
for the slowest island) spread over the H steps of a round; per-step costs (the inner collectives' latency and
bytes) paid every step."""

import dataclasses

import pytest

from islands.plan import Candidate, Link, Profile, Topology, predict
from islands.sync.outer import make_outer
from islands.sync.outer.diloco import DiLoCo

STEP_S = 0.010
NUMEL = 100_000


def _profile(samples=(STEP_S,) * 8) -> Profile:
    return Profile(
        fingerprint="test",
        device="cpu",
        batch_size=8,
        forward_s=STEP_S / 3,
        backward_s=STEP_S / 2,
        optimizer_s=STEP_S / 6,
        step_s=STEP_S,
        spread=0.0,
        activation_peak_bytes=1000,
        param_bytes=NUMEL * 4,
        grad_bytes=NUMEL * 4,
        optimizer_bytes=2 * NUMEL * 4,
        buffer_bytes=0,
        param_numels=[NUMEL],
        step_samples=list(samples),
        steps=len(samples),
    )


LINK = Link(100e6, 0.005, "100mbit,5ms")  # 5 ms one way: 2 x 5 ms of latency per 2-rank all-reduce


def _diloco(h: int, round_s: float = 0.0) -> Candidate:
    outer = make_outer(f"diloco:inner_steps={h}")
    assert isinstance(outer, DiLoCo)
    return Candidate(f"diloco:inner_steps={h}", "single", outer, round_s=round_s)


def test_a_rounds_costs_are_spread_over_its_steps():
    prof = _profile()
    at = {h: predict(_diloco(h, round_s=0.040), prof, Topology(2, 2), LINK, LINK) for h in (10, 20)}
    exchange = LINK.seconds("all_reduce", 2, NUMEL * 4)  # one fp32 all-reduce of the delta per round
    for h, p in at.items():
        assert p.compute_s == pytest.approx(STEP_S)
        assert p.strategy_s == pytest.approx(0.040 / h)
        assert p.cross_comm_s == pytest.approx(exchange / h)  # equal steps: no wait for a slower island
        assert p.inside_comm_s == 0.0
        assert p.step_s == pytest.approx(STEP_S + (0.040 + exchange) / h)
    assert at[10].step_s - STEP_S == pytest.approx(2 * (at[20].step_s - STEP_S))


def test_the_wait_for_the_slowest_island_is_paid_once_per_round():
    """Steps of 5 or 15 ms: over H steps each island's sum spreads by sqrt(H) x one step's, and a round waits for the
    slower of 2: E[max] - mean = sqrt(H) x 2.5 ms per round, spread over H steps."""
    prof = _profile((0.005, 0.015) * 4)
    h = 16
    p = predict(_diloco(h), prof, Topology(2, 2), LINK, LINK)
    exchange = LINK.seconds("all_reduce", 2, NUMEL * 4)
    assert p.cross_comm_s == pytest.approx((exchange + 0.0025 * h**0.5) / h)


def test_a_flat_strategy_pays_its_collectives_latency_every_step():
    prof = _profile()
    slow = dataclasses.replace(LINK, latency_s=0.010)
    fast = predict(Candidate("ddp", "ddp"), prof, Topology(2, 1), LINK, LINK)
    late = predict(Candidate("ddp", "ddp"), prof, Topology(2, 1), slow, slow)
    # a 2-rank ring all-reduce: 2 (n - 1) = 2 latency steps; one bucket, so nothing overlaps the backward pass
    assert late.inside_comm_s - fast.inside_comm_s == pytest.approx(2 * 0.005)
    assert fast.inside_comm_s == pytest.approx(LINK.seconds("all_reduce", 2, NUMEL * 4))
    assert fast.strategy_s == 0.0 and fast.cross_comm_s == 0.0


def test_the_outer_round_cost_is_an_input_of_the_prediction():
    p = predict(_diloco(50, round_s=0.005), _profile(), Topology(2, 2), LINK, LINK)
    assert "5.00 ms per round over 50 steps" in p.inputs["outer round"]
    assert p.as_dict()["strategy_s"] == pytest.approx(0.005 / 50)


def test_combining_every_islands_payload_adds_to_the_rounds_local_work():
    c = dataclasses.replace(_diloco(50, round_s=0.005), gather_s=0.003)
    p = predict(c, _profile(), Topology(4, 4), LINK, LINK)
    assert p.strategy_s == pytest.approx(0.008 / 50)
    assert "combining 4 islands' payloads rather than one: 3.00 ms more" in p.inputs["outer round"]


def test_a_flat_strategys_measured_local_work_is_paid_every_step():
    topo = Topology(workers=2, islands=1)
    plain = predict(Candidate("ddp", "ddp"), _profile(), topo, LINK, LINK)
    busy = predict(Candidate("ddp", "ddp", local_s=0.004), _profile(), topo, LINK, LINK)
    assert busy.strategy_s == pytest.approx(0.004)
    assert busy.step_s == pytest.approx(plain.step_s + 0.004)
    assert busy.inside_comm_s == plain.inside_comm_s  # the link's part is unchanged


def test_fsdp_pays_an_all_reduce_of_the_whole_gradient_for_its_reduce_scatter():
    # a probed link whose reduce-scatter would cost twice its all-reduce per recorded byte: gloo's reduce_scatter
    # reduces the whole tensor, and FSDP's ledger records the whole tensor, so it is timed as the all-reduce
    from islands.plan.links import AlphaBeta

    fitted = {
        "all_reduce": AlphaBeta(0.001, 1e-8, "probe"),
        "all_gather": AlphaBeta(0.002, 2e-8, "probe"),
        "reduce_scatter": AlphaBeta(0.003, 2e-8, "probe"),
    }
    link = Link(100e6, 0.0, "probe", fitted)
    traffic = (("fsdp_all_gather", 1000, 1000), ("fsdp_reduce_scatter", 2000, 1000), ("fsdp_grad_norm", 4, 4))
    c = Candidate("fsdp", "fsdp", None, traffic, {"params": 1, "grads": 1, "optimizer": 1})
    pred = predict(c, _profile(samples=(STEP_S,) * 8), Topology(workers=2, islands=1), link, link)
    wire = (0.002 + 2e-8 * 1000) + (0.001 + 1e-8 * 2000) + (0.001 + 1e-8 * 4)
    assert pred.inside_comm_s == pytest.approx(wire)
