"""Aggregators: robustness properties (hypothesis), NaN/Inf policy, state, spec parsing."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from islands.aggregate import (
    Bucketing,
    CenteredClipping,
    CoordinateMedian,
    GeometricMedian,
    Krum,
    Mean,
    MultiKrum,
    NearestNeighborMixing,
    TooFewInputsError,
    TrimmedMean,
    parse_aggregator,
    valid_specs,
)

FAST = settings(max_examples=60, deadline=None)
honest_value = st.floats(-1e3, 1e3, width=32)
# Anything finite a float32 can hold, the float maximum included.
arbitrary_value = st.floats(allow_nan=False, allow_infinity=False, width=32)
EXAMPLE_SPECS = [
    "mean",
    "median",
    "trimmed-mean:beta=0.25",
    "krum:f=2",
    "multi-krum:f=2,m=4",
    "geomed",
    "cclip:tau=1.0",
    "nnm+krum:f=2",
    "bucketing:s=2+median",
]


@st.composite
def honest_and_byzantine(draw, max_f_fraction):
    """(honest rows, byzantine rows) with d coordinates; f chosen so f/n < max_f_fraction."""
    d = draw(st.integers(1, 4))
    n_honest = draw(st.integers(2, 7))
    # Largest f with f / (n_honest + f) < max_f_fraction.
    f_max = max(0, math.ceil(max_f_fraction * n_honest / (1 - max_f_fraction)) - 1)
    f = draw(st.integers(0, f_max))
    honest = [torch.tensor(draw(st.lists(honest_value, min_size=d, max_size=d))) for _ in range(n_honest)]
    byz = [torch.tensor(draw(st.lists(arbitrary_value, min_size=d, max_size=d))) for _ in range(f)]
    return honest, byz


def _inside_honest_range(out, honest, rel=1e-5):
    h = torch.stack(honest)
    lo, hi = h.min(0).values, h.max(0).values
    slack = rel * torch.maximum(lo.abs(), hi.abs()).clamp_min(1.0)
    return bool(((out >= lo - slack) & (out <= hi + slack)).all())


@FAST
@given(honest_and_byzantine(0.5), st.randoms())
def test_median_stays_in_honest_range_when_fewer_than_half_are_arbitrary(case, rnd):
    honest, byz = case
    inputs = honest + byz
    rnd.shuffle(inputs)
    out = CoordinateMedian().aggregate(inputs)
    assert _inside_honest_range(out, honest)


@FAST
@given(honest_and_byzantine(0.5), st.floats(0, 0.49), st.randoms())
def test_trimmed_mean_stays_in_honest_range_when_beta_covers_f(case, extra, rnd):
    honest, byz = case
    n, f = len(honest) + len(byz), len(byz)
    beta = f / n + extra * (0.4999 - f / n)  # anywhere in [f/n, 0.5)
    inputs = honest + byz
    rnd.shuffle(inputs)
    out = TrimmedMean(beta).aggregate(inputs)
    assert _inside_honest_range(out, honest)


def test_one_huge_vector_moves_the_mean_but_not_the_median():
    honest = [torch.tensor([1.0, 2.0]), torch.tensor([1.5, 2.5]), torch.tensor([0.5, 1.5])]
    bad = torch.tensor([1e30, -1e30])
    assert not _inside_honest_range(Mean().aggregate(honest + [bad]), honest)
    assert _inside_honest_range(CoordinateMedian().aggregate(honest + [bad]), honest)


def test_median_of_even_count_averages_the_two_middle_values():
    out = CoordinateMedian().aggregate([torch.tensor([v]) for v in (4.0, 1.0, 3.0, 2.0)])
    assert out.item() == 2.5


def test_trimmed_mean_trims_floor_beta_n_from_each_side():
    xs = [torch.tensor([v]) for v in (100.0, 1.0, 2.0, 3.0, -100.0)]
    assert TrimmedMean(0.2).aggregate(xs).item() == pytest.approx(2.0)
    assert TrimmedMean(0.0).aggregate(xs).item() == pytest.approx(1.2)


@st.composite
def cluster_and_outliers(draw):
    f = draw(st.integers(0, 3))
    n = draw(st.integers(2 * f + 3, 2 * f + 6))  # Krum's condition n > 2f + 2 (LIT-344)
    d = draw(st.integers(2, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    centre = torch.randn(d, generator=g)
    honest = [centre + 0.01 * torch.randn(d, generator=g) for _ in range(n - f)]
    far = draw(st.floats(10.0, 1e30))
    collude = draw(st.booleans())  # identical outliers support each other: the harder case
    direction = torch.randn(d, generator=g)
    byz = [centre + far * (direction if collude else torch.randn(d, generator=g)) for _ in range(f)]
    order = torch.randperm(n, generator=g).tolist()
    inputs = [(honest + byz)[i] for i in order]
    honest_positions = {p for p, i in enumerate(order) if i < n - f}
    return inputs, honest_positions, f


@FAST
@given(cluster_and_outliers())
def test_krum_selects_an_honest_vector(case):
    inputs, honest_positions, f = case
    krum = Krum(f)
    out = krum.aggregate(inputs)
    assert krum.last_selected[0] in honest_positions
    assert torch.equal(out, inputs[krum.last_selected[0]])


@FAST
@given(cluster_and_outliers())
def test_multi_krum_averages_only_honest_vectors(case):
    inputs, honest_positions, f = case
    m = len(inputs) - f
    mk = MultiKrum(f, m)
    mk.aggregate(inputs)
    assert set(mk.last_selected) == honest_positions


def test_nnm_then_krum_and_bucketing_then_median_ignore_far_outliers():
    g = torch.Generator().manual_seed(0)
    honest = [torch.ones(3) + 0.01 * torch.randn(3, generator=g) for _ in range(6)]
    inputs = honest + [torch.full((3,), 1e20), torch.full((3,), -1e20)]
    for spec in ("nnm+krum:f=2", "bucketing:s=2+median", "nnm+multi-krum:f=2,m=4", "geomed", "trimmed-mean:beta=0.25"):
        out = parse_aggregator(spec).aggregate(inputs)
        assert (out - 1).abs().max() < 0.1, spec


@FAST
@given(st.integers(2, 6), st.integers(1, 5), st.integers(0, 2**31))
def test_geometric_median_of_symmetric_inputs_is_the_centre(pairs, d, seed):
    g = torch.Generator().manual_seed(seed)
    centre = torch.randn(d, generator=g, dtype=torch.float64)
    offsets = [torch.randn(d, generator=g, dtype=torch.float64) for _ in range(pairs)]
    inputs = [centre + v for v in offsets] + [centre - v for v in offsets]
    out = GeometricMedian(max_iter=500, tol=1e-12).aggregate(inputs)
    assert torch.allclose(out, centre, atol=1e-6)


def test_geometric_median_converges_where_the_start_is_off_centre():
    # An equilateral triangle: its coordinate median (the start) is not its centroid, the answer.
    s = math.sqrt(3) / 2
    inputs = [torch.tensor(v, dtype=torch.float64) for v in ([1.0, 0.0], [-0.5, s], [-0.5, -s])]
    gm = GeometricMedian(max_iter=1000, tol=1e-14)
    out = gm.aggregate(inputs)
    assert gm.last_converged and gm.last_iterations > 1
    assert torch.allclose(out, torch.zeros(2, dtype=torch.float64), atol=1e-5)


@FAST
@given(st.integers(3, 8), st.integers(2, 5), st.integers(0, 2**31))
def test_geometric_median_is_a_stationary_point(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(d, generator=g, dtype=torch.float64) for _ in range(n)]
    z = GeometricMedian(max_iter=5000, tol=1e-15).aggregate(inputs)
    dists = [torch.linalg.vector_norm(z - x) for x in inputs]
    k = min(range(n), key=lambda i: dists[i])
    pull = sum((inputs[k] - x) / torch.linalg.vector_norm(inputs[k] - x) for i, x in enumerate(inputs) if i != k)
    objective = lambda p: sum(torch.linalg.vector_norm(p - x) for x in inputs)  # noqa: E731
    if torch.linalg.vector_norm(pull) <= 1:
        # the median is the input x_k itself (the other inputs' unit pulls cannot move it off; the
        # gradient is not defined there), which Weiszfeld's iterates approach without reaching
        # (seed 123672: 2.5e-6 away after 5000 iterations): z must be as good as x_k
        assert objective(z) - objective(inputs[k]) <= 1e-6 * objective(inputs[k])
        return
    if torch.linalg.vector_norm(pull) <= 1.01:
        # just off x_k (seed 2021182: pull 1.0019, median 9e-5 from x_k): Weiszfeld creeps there and
        # the cap stops it with a gradient of ~1e-3 but an objective within 4e-7 of the optimum; the
        # property is the objective: within 1e-6 of a run 10x longer and of x_k
        best = min(objective(GeometricMedian(max_iter=50_000, tol=0).aggregate(inputs)), objective(inputs[k]))
        assert objective(z) - best <= 1e-6 * best
        return
    grad = sum((z - x) / dn for x, dn in zip(inputs, dists))
    assert torch.linalg.vector_norm(grad) < 1e-3


def test_geometric_median_respects_its_iteration_cap():
    s = math.sqrt(3) / 2
    inputs = [torch.tensor(v, dtype=torch.float64) for v in ([1.0, 0.0], [-0.5, s], [-0.5, -s])]
    gm = GeometricMedian(max_iter=2, tol=0.0)
    gm.aggregate(inputs)
    assert gm.last_iterations == 2 and not gm.last_converged


def test_geometric_median_on_identical_inputs_does_not_divide_by_zero():
    out = GeometricMedian().aggregate([torch.ones(4)] * 5)
    assert torch.equal(out, torch.ones(4))


def _all_aggregators(f=2):
    specs = EXAMPLE_SPECS + ["bucketing:s=3+nnm:f=2+geomed:iters=5"]
    return [parse_aggregator(s.replace("f=2", f"f={f}")) for s in specs]


@FAST
@given(st.integers(0, 2**31), st.integers(1, 2), st.sampled_from(["nan", "inf", "-inf", "mixed"]))
def test_non_finite_inputs_are_dropped_before_any_aggregator_sees_them(seed, bad_count, kind):
    g = torch.Generator().manual_seed(seed)
    honest = [torch.randn(5, generator=g) for _ in range(8)]
    bad = []
    for i in range(bad_count):
        t = torch.randn(5, generator=g)
        t[i] = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}.get(
            kind, float("nan") if i else float("inf")
        )
        bad.append(t)
    inputs = honest[:3] + bad + honest[3:]
    # A dropped input counts against f, so the clean reference tolerates f - bad_count.
    for with_bad, clean in zip(_all_aggregators(), _all_aggregators(f=2 - bad_count)):
        out = with_bad.aggregate(inputs)
        assert torch.isfinite(out).all()
        # Same result as if the bad inputs had never been sent: they reached nothing.
        assert torch.equal(out, clean.aggregate(honest)), repr(with_bad)
        assert with_bad.last_report.dropped == tuple(range(3, 3 + bad_count))
        assert with_bad.dropped_total == bad_count


def _naive_centered_clipping(centre, inputs, tau):
    # The update as commonly written (e.g. ByzFL): no filtering, arithmetic on whatever arrives.
    step = torch.zeros_like(centre)
    for x in inputs:
        diff = x - centre
        step += diff * min(1.0, tau / float(torch.linalg.vector_norm(diff)))
    return centre + step / len(inputs)


def test_centered_clipping_centre_survives_an_inf_input_that_poisons_the_naive_update():
    g = torch.Generator().manual_seed(1)
    rounds = [[torch.randn(4, generator=g) for _ in range(5)] for _ in range(4)]
    attacked = [list(r) for r in rounds]
    attacked[0][2] = torch.tensor([float("inf"), 0.0, 0.0, 0.0])

    # The naive centre, once hit, stays NaN for every later round.
    naive = torch.zeros(4)
    for r in attacked:
        naive = _naive_centered_clipping(naive, r, tau=1.0)
        assert torch.isnan(naive).any()

    ours, reference = CenteredClipping(tau=1.0), CenteredClipping(tau=1.0)
    reference.aggregate([t for i, t in enumerate(rounds[0]) if i != 2])
    ours.aggregate(attacked[0])
    assert torch.isfinite(ours.centre).all()
    for r in attacked[1:]:
        out = ours.aggregate(r)
        assert torch.isfinite(out).all()
        assert torch.equal(out, reference.aggregate(r))
    assert torch.equal(ours.state_dict()["centre"], reference.state_dict()["centre"])


def test_centered_clipping_moves_at_most_tau_per_iteration_and_restores_state():
    cc = CenteredClipping(tau=0.5, iters=2)
    cc.load_state_dict({"centre": torch.zeros(3)})
    out = cc.aggregate([torch.full((3,), 1e6), torch.full((3,), -1e3), torch.full((3,), 7e4)])
    assert torch.linalg.vector_norm(out) <= 0.5 * 2 + 1e-6
    copy = CenteredClipping(tau=0.5, iters=2)
    copy.load_state_dict(cc.state_dict())
    nxt = [torch.ones(3), 2 * torch.ones(3), 3 * torch.ones(3)]
    assert torch.equal(cc.aggregate(nxt), copy.aggregate(nxt))
    with pytest.raises(ValueError, match="NaN or Inf"):
        copy.load_state_dict({"centre": torch.tensor([float("nan"), 0.0, 0.0])})
    with pytest.raises(ValueError, match="reset"):
        cc.aggregate([torch.ones(5)] * 3)


def test_too_few_finite_inputs_is_a_clear_error():
    inputs = [torch.randn(3) for _ in range(3)] + [torch.full((3,), float("nan"))]
    # The NaN sender counts against f = 2, leaving f = 1: Krum then needs 4 inputs.
    with pytest.raises(TooFewInputsError, match=r"at least 4 finite inputs, 3 remain after dropping 1"):
        Krum(f=2).aggregate(inputs)
    with pytest.raises(TooFewInputsError):
        Mean().aggregate([torch.full((2,), float("inf"))])


def test_a_dropped_input_counts_against_f():
    honest = [torch.tensor([0.0]), torch.tensor([0.1]), torch.tensor([5.0])]
    krum = Krum(f=1)
    krum.aggregate(honest + [torch.tensor([float("nan")])])  # n = 4, f = 1, one NaN: still runs
    assert krum.effective_f() == 0 and krum.last_report.used == 3
    krum.aggregate(honest + [torch.tensor([1.0])])
    assert krum.effective_f() == 1


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="empty"):
        Mean().aggregate([])
    with pytest.raises(ValueError, match="input 1 is"):
        Mean().aggregate([torch.zeros(3), torch.zeros(4)])
    with pytest.raises(TypeError, match="floating"):
        Mean().aggregate([torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(TypeError, match="list of tensors"):
        Mean().aggregate(torch.zeros(3, 3))


def test_bucketing_is_reproducible_from_its_seed_and_state():
    inputs = [torch.tensor([float(i)]) for i in range(7)]
    a, b = Bucketing(Mean(), s=2, seed=3), Bucketing(Mean(), s=2, seed=3)
    assert [a.aggregate(inputs) for _ in range(3)] == [b.aggregate(inputs) for _ in range(3)]
    saved = a.state_dict()
    first = a.aggregate(inputs)
    firsts = a.last_buckets
    c = Bucketing(Mean(), s=2, seed=99)
    c.load_state_dict(saved)
    assert torch.equal(c.aggregate(inputs), first) and c.last_buckets == firsts
    assert sorted(i for bucket in firsts for i in bucket) == list(range(7))
    assert [len(bucket) for bucket in firsts] == [2, 2, 2, 1]


def test_nnm_with_f_zero_mixes_every_input_into_the_mean():
    inputs = [torch.tensor([float(i), -float(i)]) for i in range(5)]
    out = NearestNeighborMixing(CoordinateMedian(), f=0).aggregate(inputs)
    assert torch.allclose(out, Mean().aggregate(inputs))


@pytest.mark.parametrize(
    "spec", EXAMPLE_SPECS + ["bucketing:s=2,seed=4+nnm+multi-krum:f=1,m=3", "geomed:iters=7,tol=0.01"]
)
def test_every_documented_spec_parses_and_its_repr_parses_back(spec):
    agg = parse_aggregator(spec)
    again = parse_aggregator(repr(agg))
    assert repr(again) == repr(agg)
    inputs = [torch.randn(3, generator=torch.Generator().manual_seed(i)) for i in range(9)]
    assert torch.equal(agg.aggregate(inputs), again.aggregate(inputs))


def test_spec_parser_builds_the_named_pieces():
    assert isinstance(parse_aggregator("median"), CoordinateMedian)
    assert parse_aggregator("trimmed-mean:beta=0.25").beta == 0.25
    nnm = parse_aggregator("nnm+krum:f=2")
    assert isinstance(nnm, NearestNeighborMixing) and nnm.f == 2 and isinstance(nnm.inner, Krum)
    b = parse_aggregator("bucketing:s=2+median")
    assert isinstance(b, Bucketing) and b.s == 2 and isinstance(b.inner, CoordinateMedian)
    cc = parse_aggregator("cclip:tau=0.5,iters=3")
    assert (cc.tau, cc.iters) == (0.5, 3)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("krum", "krum needs f="),
        ("average", "unknown aggregator 'average'"),
        ("krum:g=1", "does not take g"),
        ("krum:f=two", "not a valid int"),
        ("nnm+median", "nnm needs f="),
        ("median+nnm", "step must come before"),
        ("trimmed-mean:beta=0.5", r"\[0, 0.5\)"),
        ("multi-krum:f=1", "needs m="),
        ("krum:f", "key=value"),
        ("", "non-empty"),
    ],
)
def test_bad_specs_raise_value_error_naming_the_fix(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_aggregator(spec)


def test_unknown_name_error_lists_every_valid_name():
    with pytest.raises(ValueError) as err:
        parse_aggregator("average")
    for name in ("mean", "median", "trimmed-mean", "krum", "multi-krum", "geomed", "cclip", "nnm", "bucketing"):
        assert name in str(err.value) and name in valid_specs()


def test_half_precision_inputs_come_back_in_their_dtype():
    inputs = [torch.randn(6).to(torch.bfloat16) for _ in range(7)]
    for agg in _all_aggregators():
        out = agg.aggregate(inputs)
        assert out.dtype == torch.bfloat16 and out.shape == (6,)


def test_aggregators_keep_input_shape_and_are_deterministic():
    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(2, 3, 4, generator=g) for _ in range(9)]
    for a, b in zip(_all_aggregators(), _all_aggregators()):
        out = a.aggregate(inputs)
        assert out.shape == (2, 3, 4)
        assert torch.equal(out, b.aggregate(inputs))
