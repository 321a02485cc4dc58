"""Pipeline pieces, cuts, schedules, held bytes and the micro-batch chooser, in one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from islands.models import MLP, ByteTransformer, sequence_loss
from islands.parallel.pipeline import (
    PipelineRunner,
    SavedTensorMeter,
    balanced_cuts,
    bubble_fraction,
    build_stages,
    choose_microbatches,
    equal_cuts,
    gpipe,
    graph_cuts,
    one_f_one_b,
    output_bytes,
    param_bytes,
    parameter_owner,
    peak_in_flight,
    pieces_of,
    simulate,
    stage_sums,
)


def _lm():
    torch.manual_seed(0)
    return ByteTransformer(16, 4, 2, 8)


def _bottleneck():
    # widths 32 -> 64 -> 4 -> 64 -> 64 -> 10: the one narrow tensor is after the second layer
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64),
        nn.ReLU(),
        nn.Linear(64, 4),
        nn.Linear(4, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.Linear(64, 10),
    )


@pytest.mark.parametrize(
    "make, x",
    [
        (_lm, torch.randint(0, 256, (3, 8))),
        (lambda: MLP(64, 16, 10), torch.randn(3, 64)),
        (_bottleneck, torch.randn(3, 32)),
    ],
)
def test_pieces_run_in_order_compute_the_model_and_stages_own_each_parameter_once(make, x):
    model = make()
    pieces = pieces_of(model)
    h = x
    for p in pieces:
        h = p(h)
    torch.testing.assert_close(h, model(x))
    for k in range(1, len(pieces) + 1):
        stages = build_stages(pieces, equal_cuts(pieces, k))
        owner = parameter_owner(stages)
        assert len(stages) == k and len(owner) == len(list(model.parameters()))
        assert {id(p) for p in model.parameters()} == set(owner)


def test_equal_cuts_minimise_the_largest_stage_and_graph_cuts_find_the_narrow_tensor():
    pieces = pieces_of(_bottleneck())
    x = torch.randn(1, 32)
    weights = [param_bytes(p) for p in pieces]
    eq = equal_cuts(pieces, 2)
    best = min(max(sum(weights[:i]), sum(weights[i:])) for i in range(1, len(pieces)))
    assert max(stage_sums(weights, eq)) == best
    acts = output_bytes(pieces, x)
    g = graph_cuts(pieces, 2, x, slack=1.0)  # wide slack: the 4-wide tensor after piece 1 wins
    assert g == [0, 2] and acts[g[1] - 1] == min(acts[:-1])
    assert max(stage_sums(weights, g)) <= 2 * best
    # no slack: graph cuts may not give up any parameter balance
    assert max(stage_sums(weights, graph_cuts(pieces, 2, x, slack=0.0))) == best


def test_balanced_cuts_follow_the_costs_not_the_parameters():
    pieces = pieces_of(_lm())  # embedding, 4 blocks, head
    assert balanced_cuts(pieces, 2, [1, 1, 1, 1, 1, 100]) == [0, 5]
    assert balanced_cuts(pieces, 3, [9, 1, 1, 1, 1, 9]) == [0, 1, 5]
    assert stage_sums([9, 1, 1, 1, 1, 9], [0, 1, 5]) == [9, 4, 9]


def test_schedules_order_peak_memory_and_idle_share():
    k, m = 4, 6
    for s in range(k):
        for plan in (gpipe(s, k, m), one_f_one_b(s, k, m)):
            assert sorted(plan) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            assert all(plan.index(("F", i)) < plan.index(("B", i)) for i in range(m))
            assert [i for kind, i in plan if kind == "B"] == list(range(m))
        assert peak_in_flight(gpipe(s, k, m)) == m
        assert peak_in_flight(one_f_one_b(s, k, m)) == min(m, k - s)
    for name in ("gpipe", "1f1b"):
        for mb in (1, 2, 4, 8):
            t = simulate(name, [1.0] * k, [2.0] * k, mb)
            assert t.bubble == pytest.approx(bubble_fraction(k, mb))
            assert t.makespan == pytest.approx((mb + k - 1) * 3.0)
    # an uneven stage sets the pace: the slowest stage's time times M plus the fill and drain
    slow = simulate("1f1b", [1, 3, 1], [1, 3, 1], 8)
    assert slow.makespan >= 8 * 6


def test_meter_counts_saved_storages_once_and_skips_parameters():
    lin = nn.Linear(8, 4)
    meter = SavedTensorMeter(lin.parameters())
    x = torch.randn(5, 8, requires_grad=True)
    with meter.forward_of(0):
        y = lin(x).relu()  # saves x (for the weight gradient) and relu's output
    assert meter.per_microbatch[0] == 5 * 8 * 4 + 5 * 4 * 4
    meter.hold(0, x)  # already counted
    assert meter.live == meter.peak == 5 * 8 * 4 + 5 * 4 * 4
    y.sum().backward()
    meter.release(0)
    assert meter.live == 0 and meter.released[0] == meter.peak


def test_one_stage_runner_is_gradient_accumulation_of_the_whole_batch():
    model = _lm().double()
    x, y = torch.randint(0, 256, (4, 8)), torch.randint(0, 256, (4, 8))
    pieces = pieces_of(model)
    runner = PipelineRunner(pieces, build_stages(pieces, [0])[0], None, "1f1b", sequence_loss)
    loss = runner.step(x, y, 4)
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = sequence_loss(model(x), y)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad)


def _bytes(b):  # synthetic: 100 bytes per sample plus 50 per micro-batch, on each of 4 stages
    return [100 * b + 50] * 4


def test_chooser_picks_the_largest_fitting_count_without_per_microbatch_cost():
    c = choose_microbatches(4, 16, "1f1b", _bytes)
    assert c.microbatches == 16 and c.option().bubble == pytest.approx(3 / 19)
    # gpipe holds every micro-batch: M x (100 b + 50) = 1600 + 50 M; 1750 bytes allow M <= 3 -> 2
    g = choose_microbatches(4, 16, "gpipe", _bytes, budget_bytes=1750)
    assert g.microbatches == 2
    assert [o.fits for o in g.options] == [True, True, False, False, False]
    # 1f1b holds min(M, 4) micro-batches on stage 0: 4 x (100 x 16/M + 50) <= 1000 needs M >= 8
    assert choose_microbatches(4, 16, "1f1b", _bytes, budget_bytes=1000).microbatches == 16
    assert [o.fits for o in choose_microbatches(4, 16, "1f1b", _bytes, budget_bytes=1000).options] == [
        False,
        False,
        False,
        True,
        True,
    ]


def test_chooser_stops_where_per_microbatch_cost_outweighs_the_bubble():
    # t(b) = 1 + 0.25 b: step (M + 3)(1 + 4/M) is 20, 15, 14, 16.5, 23.75 for M = 1, 2, 4, 8, 16
    c = choose_microbatches(4, 16, "gpipe", _bytes, microbatch_seconds=lambda b: 1 + 0.25 * b)
    assert c.microbatches == 4
    assert [o.predicted_step for o in c.options] == pytest.approx([20, 15, 14, 16.5, 23.75])


def test_chooser_and_cuts_reject_bad_input_clearly():
    with pytest.raises(ValueError, match="no micro-batch count fits"):
        choose_microbatches(4, 16, "gpipe", _bytes, budget_bytes=100)
    with pytest.raises(ValueError, match="do not divide the batch of 16"):
        choose_microbatches(4, 16, "gpipe", _bytes, candidates=[3])
    pieces = pieces_of(_lm())
    with pytest.raises(ValueError, match="cannot make 7 pipeline stages from 6 pieces"):
        equal_cuts(pieces, 7)
    with pytest.raises(ValueError, match="cannot make 0 pipeline stages"):
        graph_cuts(pieces, 0, torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="one non-negative cost per piece"):
        balanced_cuts(pieces, 2, [1, 2])
    with pytest.raises(ValueError, match="must begin at 0"):
        build_stages(pieces, [1, 3])
    with pytest.raises(ValueError, match="does not split into 3 equal micro-batches"):
        PipelineRunner(pieces, build_stages(pieces, [0])[0], None, "gpipe", sequence_loss).step(
            torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long), 3
        )
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        PipelineRunner(pieces, build_stages(pieces, [0])[0], None, "zigzag", sequence_loss)
    with pytest.raises(TypeError, match="cannot split Linear"):
        pieces_of(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="microbatches must be a positive int"):
        gpipe(0, 2, 0)
    assert math.isclose(bubble_fraction(2, 1), 0.5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"cuts": "layers"}, "cuts='layers' is not a cut policy"),
        ({"microbatches": "many"}, "give a positive integer dividing the batch, or 'auto'"),
        ({"microbatches": "0"}, "give a positive integer"),
        ({"pipeline_schedule": "zigzag"}, "must be one of gpipe, 1f1b"),
        ({"inner": "pipeline", "stages": 3}, "stages=3 needs one worker per stage"),
        ({"inner": "pipeline", "microbatches": "5"}, "microbatches=5 does not divide the pipeline's batch of 32"),
        ({"inner": "pipeline", "task": "digits", "workers": 4}, "only 3 pieces"),
        ({"inner": "pipeline", "compress": "topk:ratio=0.1"}, "does not yet combine with compressor='topk:ratio=0.1'"),
        ({"inner": "pipeline", "ckpt_every": 5}, "does not yet combine with checkpoint.every=5"),
    ],
)
def test_config_errors_name_the_fix(overrides, message):
    from islands.app.validate import validate
    from islands.config import ConfigError, from_mapping

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(from_mapping({"workers": 2, "global_batch": 32, **overrides}))


def test_config_accepts_a_pipeline_job():
    from islands.app.validate import validate
    from islands.config import from_mapping

    cfg = validate(
        from_mapping(
            {"workers": 4, "inner": "pipeline", "stages": 4, "microbatches": "auto", "cuts": "balanced", "n_layers": 2}
        )
    )
    assert cfg.inner_strategy == "pipeline"
