"""Outer spec parsing: defaults, nested compress/aggregate specs, and errors that name the fix."""

from __future__ import annotations

import pytest

from islands.spec import Spec, parse
from islands.sync.outer import PARAMS, STRATEGIES, make_outer, parse_outer
from islands.sync.outer.diloco import DiLoCo
from islands.sync.outer.outer_opt import OuterSGD, PrimalAveraging


def test_defaults_follow_the_measurements_and_the_papers():
    s = parse_outer("diloco")
    # the outer step our benches found best (docs/outer-strategies.md, "Default outer step"): plain SGD, lr sqrt(2)
    assert (s["inner_steps"], s["outer"], s["outer_lr"], s["momentum"], s["lr_scale"]) == (
        100,
        "sgd",
        2**0.5,
        0.0,
        "none",
    )
    st = parse_outer("streaming-diloco")
    assert (st["outer"], st["outer_lr"], st["momentum"]) == ("sgd", 2**0.5, 0.0)
    # LIT-212's outer step is one spec away
    paper = make_outer("diloco:outer=nesterov,outer_lr=0.7,momentum=0.9").outer.opt
    assert (paper.lr, paper.momentum, paper.nesterov) == (0.7, 0.9, True)
    st = parse_outer("streaming-diloco")
    assert st["bits"] == 4 and st["fragments"] >= 2 and st["tau"] >= 1  # LIT-214: streamed, overlapped, 4-bit
    assert s.given == frozenset()


def test_values_are_typed_and_given_keys_tracked():
    s = parse_outer("diloco:inner_steps=50, outer_lr=0.5 ,momentum=0")
    assert s["inner_steps"] == 50 and s["outer_lr"] == 0.5 and s["momentum"] == 0.0
    assert s.given == {"inner_steps", "outer_lr", "momentum"}


def test_nested_aggregate_spec_keeps_its_own_commas_and_colons():
    s = parse_outer("diloco:inner_steps=5,aggregator=(trimmed-mean:beta=0.2)")
    assert s["aggregator"] == "trimmed-mean:beta=0.2" and s["inner_steps"] == 5
    s = parse_outer("local-sgd:aggregator=(nnm:f=1+krum:f=1),every=3")
    assert s["aggregator"] == "nnm:f=1+krum:f=1" and s["every"] == 3
    assert s.spec == parse("local-sgd:aggregator=(nnm:f=1+krum:f=1),every=3")


def test_older_unparenthesised_nested_specs_and_names_still_read():
    s = parse_outer("diloco:inner_steps=5,aggregate=trimmed-mean:beta=0.2")
    assert s["aggregate"] == s["aggregator"] == "trimmed-mean:beta=0.2" and s["inner_steps"] == 5
    s = parse_outer("local-sgd:aggregate=nnm:f=1+krum:f=1,every=3")
    assert s["aggregator"] == "nnm:f=1+krum:f=1" and s["every"] == 3
    s = parse_outer("diloco:compress=randomk:ratio=0.01,seed=3,inner_steps=7")  # seed is randomk's, not diloco's
    assert s["compressor"] == "randomk:ratio=0.01,seed=3" and s["inner_steps"] == 7


@pytest.mark.parametrize(
    "spec, words",
    [
        ("dilocoo", ["unknown outer strategy", "did you mean 'diloco'", "local-sgd"]),
        ("diloco:inner=5", ["does not take inner", "did you mean inner_steps"]),
        ("diloco:inner_steps=five", ["inner_steps=five is not a valid int"]),
        ("diloco:inner_steps=0", ["1 <= fragments <= inner_steps", "inner_steps=0"]),
        ("diloco:inner_steps=5,inner_steps=6", ["given twice"]),
        ("diloco:outer=adam", ["outer optimizer must be", "nesterov"]),
        ("diloco:outer=primal,momentum=0.5", ["primal", "momentum"]),
        ("diloco:weight=0.3", ["outer=primal only"]),
        ("diloco:momentum=1.0", ["momentum must be in [0, 1)"]),
        ("streaming-diloco:inner_steps=4,fragments=5", ["fragments <= inner_steps", "fragments=5, inner_steps=4"]),
        ("streaming-diloco:inner_steps=4,tau=4", ["tau must be in [0, inner_steps)", "tau=4, inner_steps=4"]),
        ("streaming-diloco:bits=8", ["bits must be 4 or 32"]),
        ("overlap-local-sgd:pull=0", ["pull in (0, 1]"]),
        ("easgd:beta=1.5", ["beta in (0, 1]"]),
        (
            "gossip:topology=(random:s=2),compress=topk",
            ["regular topology (ring, exp)", "push-sum"],
        ),  # CHOCO needs regular
        ("local-sgd:compress=(topkq:bits=3)", ["bits=3 is not a valid 2 | 4 | 8 | 32"]),
        ("diloco:compressor=(powersgd:rnk=2)", ["compressor", "does not take rnk", "rank"]),
        ("diloco:compressor=(topk),aggregator=(median)", ["compressor and a robust aggregator"]),
        ("diloco:warm_start=-1", ["warm_start must be >= 0"]),
        ("local-sgd:aggregate=nope", ["unknown aggregator"]),
        ("", ["non-empty"]),
    ],
)
def test_bad_specs_raise_value_error_naming_the_fix(spec, words):
    with pytest.raises(ValueError) as e:
        parse_outer(spec)
    for w in words:
        assert w in str(e.value), f"{w!r} not in: {e.value}"


def test_config_validation_reports_outer_errors_as_config_errors():
    from islands.app.validate import validate
    from islands.config import ConfigError, from_mapping

    with pytest.raises(ConfigError, match="unknown outer strategy"):
        validate(from_mapping({"workers": 2, "islands": 2, "outer": "nope"}))
    cfg = validate(from_mapping({"workers": 4, "islands": 2, "outer": "diloco:inner_steps=10"}))
    assert cfg.outer.strategy.name == "diloco"


def test_every_declared_parameter_reaches_the_constructor():
    assert set(PARAMS) == set(STRATEGIES)
    for name in PARAMS:
        strategy = make_outer(name, warmup=3)
        assert strategy.name == name
    # every parameter given explicitly, with its declared default, reaches the constructor without complaint
    for name, params in PARAMS.items():
        given = {k: d for k, (d, _, _) in params.items() if d is not None and k != "weight"}  # weight: primal only
        assert make_outer(Spec(name, given), warmup=3).name == name


def test_post_local_sgd_switches_at_the_end_of_the_warmup_unless_given():
    s = make_outer("post-local-sgd:every=4", warmup=7)
    assert s.switch == 7  # SOTA-216: the first LR decay is the end of warm-up
    assert [s.due(i) for i in range(12)] == [True] * 7 + [False, False, False, True, False]
    assert make_outer("post-local-sgd:every=4,switch=2", warmup=7).switch == 2
    assert make_outer("post-local-sgd:every=4,switch=-1", warmup=7).switch == 7  # the older spelling of "warm-up"


def test_warm_start_wraps_the_strategy():
    from islands.sync.outer import WarmStart

    s = make_outer("diloco:inner_steps=10,warm_start=40")
    assert isinstance(s, WarmStart) and s.steps == 40 and s.outer.inner_steps == 10
    assert not isinstance(make_outer("diloco:inner_steps=10"), WarmStart)
    with pytest.raises(ValueError, match="does not take warm_start"):
        parse_outer("local-sgd:every=4,warm_start=10")


def test_nested_specs_become_objects():
    from islands.aggregate import CoordinateMedian
    from islands.compress import PowerSGD

    d = make_outer("diloco:inner_steps=100,compress=(powersgd:rank=4)")
    assert isinstance(d.exchange.compressor.inner, PowerSGD) and d.exchange.compressor.inner.rank == 4
    assert isinstance(make_outer("local-sgd:aggregator=median").exchange.aggregator, CoordinateMedian)
    assert make_outer("diloco:compressor=none").exchange.compressor is None  # none: no compressor, as before


def test_outer_optimizer_choice():
    default = make_outer("diloco").outer.opt
    assert isinstance(default, OuterSGD) and not default.nesterov and default.momentum == 0
    assert make_outer("diloco:outer=nesterov,momentum=0.9").outer.opt.nesterov
    assert not make_outer("diloco:outer=sgd,momentum=0.9").outer.opt.nesterov  # heavy ball
    assert isinstance(make_outer("diloco:outer=primal,weight=0.3").outer.opt, PrimalAveraging)
    with pytest.raises(ValueError, match="sync_inner_state needs fragments=1"):
        DiLoCo.from_options(inner_steps=4, fragments=2, sync_inner_state=True)
