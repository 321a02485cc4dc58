"""Links: the alpha-beta fit on synthetic timings, link specs, and the ring formulas."""

import pytest

from islands.plan.links import Link, LinkError, fit_alpha_beta, link_from_probe, parse_link


def test_fit_recovers_alpha_and_beta_from_noisy_timings():
    alpha, beta = 150e-6, 1 / 1.2e9  # 150 us and 1.2 GB/s
    sizes = [4e3, 64e3, 512e3, 2e6, 8e6]
    noise = [1.03, 0.98, 1.01, 0.99, 1.02]
    times = [(alpha + beta * s) * k for s, k in zip(sizes, noise)]
    fit = fit_alpha_beta(sizes, times, "synthetic")
    assert fit.alpha_s == pytest.approx(alpha, rel=0.25)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=0.05)
    assert 0 < fit.rel_error < 0.05
    assert fit.seconds(1e6) == pytest.approx(alpha + beta * 1e6, rel=0.05)


def test_fit_never_gives_a_negative_latency():
    fit = fit_alpha_beta([1e3, 1e6], [1e-9, 1e-3])  # a line through these would cross below zero
    assert fit.alpha_s >= 0 and fit.beta_s_per_byte > 0


def test_fit_needs_two_sizes():
    with pytest.raises(ValueError, match="distinct sizes"):
        fit_alpha_beta([1e3, 1e3], [1e-3, 2e-3])


def test_link_spec_forms():
    link = parse_link("100mbit,20ms")
    assert link.rate_bps == 100e6 and link.latency_s == pytest.approx(0.02)
    assert parse_link("1gbit").latency_s == 0.0
    assert parse_link("500kbit, 300us").latency_s == pytest.approx(300e-6)
    with pytest.raises(LinkError, match="kbit/mbit/gbit"):
        parse_link("100furlongs")


def test_ring_formulas_follow_the_ledger_convention():
    link = Link(8e9, 1e-3, "spec")  # 1 GB/s
    # all-reduce of B bytes over 4 ranks: 6 latency steps, 2*3/4 * B on the wire
    assert link.seconds("all_reduce", 4, 1e9) == pytest.approx(6e-3 + 1.5)
    # all-gather: the ledger's sent is the own chunk; n-1 chunks travel
    assert link.seconds("all_gather", 4, 1e9) == pytest.approx(3e-3 + 3.0)
    assert link.seconds("all_reduce", 1, 1e9) == 0.0


def test_a_probe_fit_scales_to_larger_groups():
    timings = {k: [(1e3, 1e-4 + 1e-9 * 1e3), (1e6, 1e-4 + 1e-9 * 1e6)] for k in ("all_reduce", "all_gather")}
    link = link_from_probe(timings, "probe")
    two = link.cost("all_reduce", 2)
    four = link.cost("all_reduce", 4)
    assert four.alpha_s == pytest.approx(3 * two.alpha_s)
    assert four.beta_s_per_byte == pytest.approx(1.5 * two.beta_s_per_byte)
