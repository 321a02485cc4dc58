"""Outer spec parsing: defaults, nested compress/aggregate specs, and errors that name the fix."""

from __future__ import annotations

import pytest

from islands.config import ConfigError, from_mapping, validate
from islands.sync.outer import PARAMS, build_outer, make_outer, parse_outer
from islands.sync.outer.diloco import DiLoCo
from islands.sync.outer.outer_opt import OuterSGD, PrimalAveraging


def test_defaults_follow_the_papers():
    s = parse_outer("diloco")
    assert (s["inner_steps"], s["outer"], s["outer_lr"], s["momentum"]) == (100, "nesterov", 0.7, 0.9)  # LIT-212
    st = parse_outer("streaming-diloco")
    assert st["bits"] == 4 and st["fragments"] >= 2 and st["tau"] >= 1  # LIT-214: streamed, overlapped, 4-bit
    assert s.given == frozenset()


def test_values_are_typed_and_given_keys_tracked():
    s = parse_outer("diloco:inner_steps=50, outer_lr=0.5 ,momentum=0")
    assert s["inner_steps"] == 50 and s["outer_lr"] == 0.5 and s["momentum"] == 0.0
    assert s.given == {"inner_steps", "outer_lr", "momentum"}


def test_nested_aggregate_spec_keeps_its_own_commas_and_colons():
    s = parse_outer("diloco:inner_steps=5,aggregate=trimmed-mean:beta=0.2")
    assert s["aggregate"] == "trimmed-mean:beta=0.2" and s["inner_steps"] == 5
    s = parse_outer("local-sgd:aggregate=nnm:f=1+krum:f=1,every=3")
    assert s["aggregate"] == "nnm:f=1+krum:f=1" and s["every"] == 3


@pytest.mark.parametrize("spec, words", [
    ("dilocoo", ["unknown outer strategy", "diloco", "local-sgd"]),
    ("diloco:inner=5", ["bad parameter", "inner_steps"]),
    ("diloco:inner_steps=five", ["inner_steps must be int"]),
    ("diloco:inner_steps=0", ["inner_steps must be >= 1"]),
    ("diloco:inner_steps=5,inner_steps=6", ["given twice"]),
    ("diloco:outer=adam", ["outer must be one of", "nesterov"]),
    ("diloco:outer=primal,momentum=0.5", ["primal", "momentum"]),
    ("diloco:weight=0.3", ["outer=primal only"]),
    ("diloco:momentum=1.0", ["momentum must be in [0, 1)"]),
    ("streaming-diloco:inner_steps=4,fragments=5", ["fragments (5) must be <= inner_steps (4)"]),
    ("streaming-diloco:inner_steps=4,tau=4", ["tau (4) must be < inner_steps (4)"]),
    ("streaming-diloco:bits=8", ["bits must be 4 or 32"]),
    ("overlap-local-sgd:pull=0", ["pull must be in (0, 1]"]),
    ("easgd:beta=1.5", ["beta must be <= 1"]),
    ("local-sgd:compress=topk", ["bad parameter", "every"]),  # params, not deltas: no compressor
    ("local-sgd:aggregate=nope", ["unknown aggregator"]),
    ("", ["non-empty"]),
])
def test_bad_specs_raise_value_error_naming_the_fix(spec, words):
    with pytest.raises(ValueError) as e:
        parse_outer(spec)
    for w in words:
        assert w in str(e.value), f"{w!r} not in: {e.value}"


def test_config_validation_reports_outer_errors_as_config_errors():
    with pytest.raises(ConfigError, match="unknown outer strategy"):
        validate(from_mapping({"workers": 2, "islands": 2, "outer": "nope"}))
    cfg = validate(from_mapping({"workers": 4, "islands": 2, "outer": "diloco:inner_steps=10"}))
    assert cfg.outer.startswith("diloco")


def test_every_declared_parameter_reaches_the_constructor():
    for name in PARAMS:
        strategy = make_outer(name, total_steps=10, warmup=3)
        assert strategy.name == name


def test_build_outer_uses_config_steps_and_warmup():
    cfg = from_mapping({"workers": 2, "islands": 2, "steps": 40, "warmup": 7, "outer": "post-local-sgd:every=4"})
    s = build_outer(cfg, world=None)
    assert s.total_steps == 40 and s.switch == 7  # SOTA-216: the first LR decay is the end of warm-up
    assert [s.due(i) for i in range(12)] == [True] * 7 + [False, False, False, True, False]


def test_outer_optimizer_choice():
    assert isinstance(make_outer("diloco", 10).opt, OuterSGD) and make_outer("diloco", 10).opt.nesterov
    assert not make_outer("diloco:outer=sgd", 10).opt.nesterov
    assert isinstance(make_outer("diloco:outer=primal,weight=0.3", 10).opt, PrimalAveraging)
    with pytest.raises(ValueError, match="sync_inner_state needs fragments=1"):
        DiLoCo(10, inner_steps=4, fragments=2, sync_inner_state=True)
