"""Attack roles do what they say; AttackPlan picks the right ranks; specs fail clearly."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from islands.aggregate import CoordinateMedian, Mean, parse_aggregator
from islands.faults.attacks import AttackPlan, alie_z, flip_targets, parse_attack, valid_attacks
from islands.faults.roles import ALIE, SignFlip
from islands.runtime.comm import Comm, CommLedger

N = 8


def honest_grads(seed=0, d=6, n=N):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(d, generator=g)
    return [base + 0.1 * torch.randn(d, generator=g) for _ in range(n)]


def test_count_means_the_last_ranks_and_ranks_means_those_ranks():
    assert parse_attack("sign-flip:count=2", N).byzantine == {6, 7}
    assert parse_attack("sign-flip:ranks=[1,5]", N).byzantine == {1, 5}
    assert parse_attack("sign-flip:ranks=1,5", N).byzantine == {1, 5}  # the older list form still reads
    assert parse_attack("ipm:eps=0.5,ranks=2,3", N).byzantine == {2, 3}
    assert parse_attack("none", N).byzantine == frozenset()
    assert not parse_attack("alie:count=3", N).is_byzantine(0)


def test_sign_flip_negates_exactly_the_byzantine_ranks_and_leaves_inputs_alone():
    xs = honest_grads()
    before = [x.clone() for x in xs]
    out = parse_attack("sign-flip:count=2", N).corrupt_all(xs)
    for r in range(N):
        assert torch.equal(out[r], -xs[r] if r >= 6 else xs[r])
        assert torch.equal(xs[r], before[r])


def test_scaled_multiplies_by_its_factor():
    xs = honest_grads()
    out = parse_attack("scaled:factor=-4,count=1", N).corrupt_all(xs)
    assert torch.equal(out[7], -4 * xs[7]) and torch.equal(out[6], xs[6])


def test_gaussian_adds_noise_of_the_stated_sigma_reproducibly():
    x = torch.zeros(20000)
    xs = [x] * 4
    plan = parse_attack("gaussian:sigma=10,ranks=2,3", 4, seed=1)
    out = plan.corrupt_all(xs)
    noise = out[3] - x
    assert abs(float(noise.std()) - 10) < 0.3 and abs(float(noise.mean())) < 0.3
    assert not torch.equal(out[2], out[3])  # each rank draws its own stream
    again = parse_attack("gaussian:sigma=10,ranks=2,3", 4, seed=1).corrupt_all(xs)
    assert torch.equal(out[3], again[3])
    saved = plan.state_dict()
    nxt = plan.corrupt_all(xs)[3]
    restored = parse_attack("gaussian:sigma=10,ranks=2,3", 4, seed=1)
    restored.load_state_dict(saved)
    assert torch.equal(restored.corrupt_all(xs)[3], nxt)


def test_alie_z_follows_the_papers_formula():
    # n = 8, f = 2: s = floor(8/2 + 1) - 2 = 3, z = Phi^-1((8 - 3) / 8) = Phi^-1(0.625) = 0.3186...
    assert alie_z(8, 2) == pytest.approx(0.31864, abs=1e-4)
    # n = 50, f = 12: s = 14, z = Phi^-1(36/50) = Phi^-1(0.72) = 0.5828...
    assert alie_z(50, 12) == pytest.approx(0.58284, abs=1e-4)
    assert [alie_z(8, f) for f in (1, 2, 3)] == sorted(alie_z(8, f) for f in (1, 2, 3))
    with pytest.raises(ValueError):
        alie_z(8, 8)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 3), st.one_of(st.none(), st.floats(0, 5)))
def test_alie_lies_within_z_std_of_the_honest_mean(seed, f, z):
    xs = honest_grads(seed)
    spec = f"alie:count={f}" + ("" if z is None else f",z={z}")
    out = parse_attack(spec, N).corrupt_all(xs)
    honest = torch.stack(xs[: N - f])
    mean, std = honest.mean(0), honest.std(0, correction=0)
    zz = alie_z(N, f) if z is None else z
    for r in range(N - f, N):
        assert torch.allclose(out[r], mean - zz * std, atol=1e-5)
        assert ((out[r] - mean).abs() <= zz * std + 1e-5).all()
    assert all(torch.equal(out[r], xs[r]) for r in range(N - f))


def test_ipm_sends_minus_eps_times_the_honest_mean():
    xs = honest_grads(3)
    out = parse_attack("ipm:eps=0.5,count=2", N).corrupt_all(xs)
    mean = torch.stack(xs[:6]).mean(0)
    assert torch.allclose(out[6], -0.5 * mean) and torch.allclose(out[7], -0.5 * mean)
    assert float(out[7] @ mean) < 0


def test_large_ipm_turns_the_mean_against_the_honest_direction_but_not_the_median():
    xs = honest_grads(4)
    sent = parse_attack("ipm:eps=10,count=3", N).corrupt_all(xs)
    true = torch.stack(xs[:5]).mean(0)
    assert float(Mean().aggregate(sent) @ true) < 0
    assert float(CoordinateMedian().aggregate(sent) @ true) > 0


def test_nan_and_inf_attacks_send_non_finite_tensors_that_aggregators_drop():
    xs = honest_grads()
    for spec in ("nan:count=2", "inf:count=2"):
        sent = parse_attack(spec, N).corrupt_all(xs)
        assert not torch.isfinite(sent[7]).any()
        agg = parse_aggregator("median")
        assert torch.equal(agg.aggregate(sent), CoordinateMedian().aggregate(xs[:6]))
        assert agg.last_report.dropped == (6, 7)


def test_dropout_sends_zeros_or_repeats_its_first_tensor():
    assert torch.equal(parse_attack("dropout:count=1", N).corrupt_all(honest_grads())[7], torch.zeros(6))
    stale = parse_attack("dropout:mode=stale,count=1", N)
    first = stale.corrupt_all(honest_grads(0))[7]
    later = stale.corrupt_all(honest_grads(1))[7]
    assert torch.equal(first, honest_grads(0)[7]) and torch.equal(later, first)
    with pytest.raises(ValueError, match="zeros' or 'stale"):
        parse_attack("dropout:mode=late,count=1", N)


def test_straggler_delays_and_sends_its_honest_tensor():
    plan = parse_attack("straggler:delay=0.2,count=1", 2)
    x = torch.ones(3)
    comm = Comm(None, CommLedger())
    start = time.perf_counter()
    assert torch.equal(plan.corrupt(x, 1, comm), x)
    assert time.perf_counter() - start >= 0.2
    start = time.perf_counter()
    plan.corrupt(x, 0, comm)
    assert time.perf_counter() - start < 0.1


def test_label_flip_maps_y_to_c_minus_1_minus_y_on_byzantine_ranks_only():
    plan = parse_attack("label-flip:count=2", N)
    y = torch.tensor([0, 1, 9, -100])
    assert torch.equal(plan.flip_labels(y, 10, 7), torch.tensor([9, 8, 0, -100]))
    assert torch.equal(plan.flip_labels(y, 10, 0), y)
    bytes_ = torch.arange(256)
    assert torch.equal(flip_targets(bytes_, 256), 255 - bytes_)
    assert torch.equal(flip_targets(flip_targets(bytes_, 256), 256), bytes_)
    # label flipping is data-side: the gradient path is untouched, and other attacks never flip.
    xs = honest_grads()
    assert all(torch.equal(a, b) for a, b in zip(plan.corrupt_all(xs), xs))
    assert torch.equal(parse_attack("sign-flip:count=2", N).flip_labels(y, 10, 7), y)


def test_label_flip_rejects_targets_that_do_not_fit():
    with pytest.raises(ValueError, match="outside"):
        flip_targets(torch.tensor([3, 10]), 10)
    with pytest.raises(TypeError, match="integer"):
        flip_targets(torch.tensor([0.5]), 10)


def test_single_process_corrupt_matches_corrupt_all_for_local_attacks():
    plan = parse_attack("scaled:factor=3,count=1", 4)
    comm = Comm(None, CommLedger())
    xs = honest_grads(n=4)
    assert torch.equal(plan.corrupt(xs[3], 3, comm), plan.corrupt_all(xs)[3])
    assert plan.corrupt(xs[0], 0, comm) is xs[0]
    assert comm.ledger.total_sent == 0


@pytest.mark.parametrize(
    "spec, message",
    [
        ("sign-flip", "count=<k>"),
        ("sign-flip:count=8", "between 1 and 7"),
        ("sign-flip:count=0", "count must be >= 1"),
        ("sign-flip:ranks=0,1,2,3,4,5,6,7", "one rank must stay honest"),
        ("sign-flip:ranks=9", "outside the world"),
        ("sign-flip:count=1,ranks=2", "not both"),
        ("sign-flip:ranks=1,1", "repeats"),
        ("flip:count=1", "unknown attack 'flip'"),
        ("scaled:count=1", "needs factor="),
        ("ipm:eps=big,count=1", "not a valid float"),
        ("sign-flip:count=1,sigma=2", "does not take sigma"),
        ("none:count=1", "attacks nobody"),
        ("straggler:delay=-1,count=1", "delay"),
        ("gaussian:sigma=0,count=1", "sigma"),
    ],
)
def test_bad_attack_specs_raise_value_error_naming_the_fix(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_attack(spec, N)


def test_unknown_attack_lists_every_attack():
    with pytest.raises(ValueError) as err:
        parse_attack("flip:count=1", N)
    for name in ("sign-flip", "scaled", "gaussian", "alie", "ipm", "nan", "dropout", "straggler", "label-flip"):
        assert name in str(err.value) and name in valid_attacks()


def test_plan_checks_ranks_and_world():
    plan = AttackPlan(SignFlip(), frozenset({3}), 4)
    with pytest.raises(ValueError, match="outside the plan"):
        plan.corrupt(torch.ones(2), 4, Comm(None, CommLedger()))
    with pytest.raises(ValueError, match="one tensor per rank"):
        plan.corrupt_all([torch.ones(2)] * 3)
    with pytest.raises(ValueError, match="honest rank"):
        AttackPlan(ALIE(), frozenset({0}), 4).corrupt(torch.ones(2), 0, Comm(None, CommLedger()))
    with pytest.raises(ValueError, match="checkpoint holds"):
        plan.load_state_dict({"spec": "alie:count=1", "attack": {}})


def test_mean_fails_and_median_holds_under_each_gradient_attack():
    # The shape the byzantine experiment will measure, in miniature: 8 workers, 2 attackers.
    xs = honest_grads(7, d=20)
    true = torch.stack(xs[:6]).mean(0)
    for spec in ("sign-flip:count=2", "scaled:factor=-100,count=2", "gaussian:sigma=100,count=2", "nan:count=2"):
        sent = parse_attack(spec, N, seed=2).corrupt_all(xs)
        robust = CoordinateMedian().aggregate(sent)
        assert torch.linalg.vector_norm(robust - true) < 0.5 * torch.linalg.vector_norm(true), spec
        naive = torch.stack(sent).mean(0)  # the plain average, no NaN filter
        broken = not torch.isfinite(naive).all() or torch.linalg.vector_norm(naive - true) > torch.linalg.vector_norm(
            robust - true
        )
        assert broken, spec
