"""islands.spec: the one grammar (parse/format), the Spec value, and registries read from constructor signatures.

The property tests run over every registry islands defines: random valid specs survive parse(format(.)) and
check, and every entry builds with any of its parameters given explicitly.
"""

from __future__ import annotations

import json
import math
from typing import Literal

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from islands.aggregate.registry import AGGREGATORS
from islands.checkpoint.policy.settings import POLICIES
from islands.compress.optim import OPTIMIZERS
from islands.compress.registry import COMPRESSORS
from islands.faults.attacks import ATTACKS
from islands.spec import (
    CHAIN,
    POSITIONAL,
    Registry,
    Spec,
    SpecError,
    bind,
    choice,
    format,
    parse,
    registries,
)
from islands.sync.outer.registry import STRATEGIES
from islands.sync.outer.topology import TOPOLOGIES
from islands.sync.wrap_policy import WRAP_POLICIES

ISLANDS_REGISTRIES = [COMPRESSORS, AGGREGATORS, ATTACKS, STRATEGIES, OPTIMIZERS, WRAP_POLICIES, TOPOLOGIES, POLICIES]


# ---- the grammar ---------------------------------------------------------------------------------------------


def test_every_value_kind_parses_to_its_type():
    s = parse(
        "a:i=3,n=-2,f=0.5,e=1e-3,big=2E+5,t=true,F=False,nothing=none,w=sqrt-islands,q='a,b',"
        'd="c=(d)",pinf=inf,ninf=-inf,l=[1,2.0,x],empty=[],s=(b:c=1)'
    )
    expect = {
        "i": 3,
        "n": -2,
        "f": 0.5,
        "e": 1e-3,
        "big": 2e5,
        "t": True,
        "F": False,
        "nothing": None,
        "w": "sqrt-islands",
        "q": "a,b",
        "d": "c=(d)",
        "pinf": math.inf,
        "ninf": -math.inf,
        "l": (1, 2.0, "x"),
        "empty": (),
        "s": Spec("b", {"c": 1}),
    }
    assert dict(s.args) == expect
    assert [type(s[k]) for k in ("i", "f", "big", "t")] == [int, float, float, bool]
    assert math.isnan(parse("a:x=nan")["x"])


def test_spec_equality_tells_1_1point0_and_true_apart():
    assert Spec("a", {"x": 1}) != Spec("a", {"x": 1.0}) and Spec("a", {"x": 1}) != Spec("a", {"x": True})
    assert Spec("a", {"x": math.nan}) == Spec("a", {"x": math.nan})  # a value equals itself, even nan
    assert Spec("a", {"x": 1, "y": 2}) == Spec("a", [("y", 2), ("x", 1)])  # canonical order
    assert hash(Spec("a", {"x": (1, Spec("b"))})) == hash(Spec("a", {"x": [1, Spec("b")]}))
    with pytest.raises(SpecError, match="given twice"):
        Spec("a", [("x", 1), ("x", 2)])
    with pytest.raises(TypeError, match="spec value"):
        Spec("a", {"x": object()})
    with pytest.raises(SpecError, match="spec name"):
        Spec("1a")


def test_nesting_chains_and_positional_values():
    s = parse("diloco:inner_steps=100,compressor=(powersgd:rank=4)")
    assert s == Spec("diloco", {"inner_steps": 100, "compressor": Spec("powersgd", {"rank": 4})})
    chain = parse("bucketing:s=2+nnm+krum:f=2")
    assert chain == Spec("bucketing", {"s": 2, CHAIN: Spec("nnm", {CHAIN: Spec("krum", {"f": 2})})})
    assert format(chain) == "bucketing:s=2+nnm+krum:f=2"
    assert parse("params:4096") == Spec("params", {POSITIONAL: 4096}) and format(parse("params:4096")) == "params:4096"
    deep = parse("a:x=(b:y=(c:z=[(d+e)]))")
    assert deep["x"]["y"]["z"][0][CHAIN] == Spec("e")


def test_older_forms_still_read():
    assert parse("sign-flip:ranks=1,5,count=2") == parse("sign-flip:count=2,ranks=[1,5]")
    # a nested spec without parentheses runs to the end of the list ...
    greedy = Spec("gossip", {"topology": Spec("random", {"s": 2, "seed": 3})})
    assert parse("gossip:topology=random:s=2,seed=3") == greedy
    # ... or, when the caller names the outer entry's keys, to the next of them
    keys = {"gossip": ["topology", "seed", "every"]}.get
    assert parse("gossip:topology=random:s=2,seed=3", keys=keys) == parse("gossip:seed=3,topology=(random:s=2)")
    assert parse("l:aggregate=nnm:f=1+krum:f=1,every=3", keys=lambda n: ["aggregate", "every"]) == parse(
        "l:aggregate=(nnm:f=1+krum:f=1),every=3"
    )


@pytest.mark.parametrize(
    "text",
    [
        "a",
        "a:b=1",
        "a:x='a\\'b'",
        "a:x='\\\\'",
        "a:x=' lead'",
        "a:x=true,y='true',z='none',w='12',v='1e'",
        "a:x=[[],[[]]]",
        "a+b+c:d=(e+f)",
    ],
)
def test_format_writes_text_that_parses_back(text):
    s = parse(text)
    assert parse(format(s)) == s
    assert format(parse(format(s))) == format(s)


def test_quoting_keeps_grammar_characters_and_look_alikes_as_text():
    s = Spec("a", {"x": "a,b", "y": "none", "z": "3", "w": "it's", "v": "", "u": "x y"})
    assert format(s) == "a:u='x y',v='',w='it\\'s',x='a,b',y='none',z='3'"
    assert parse(format(s)) == s
    assert format(Spec("a", {"x": "sqrt-islands", "y": "a.b_c"})) == "a:x=sqrt-islands,y=a.b_c"  # no needless quotes


@pytest.mark.parametrize(
    "text, position, words",
    [
        ("", 0, "empty spec"),
        ("a:", 2, "expected a value"),
        ("a:b=", 4, "expected a value"),
        ("a:b=1,b=2", 6, "b is given twice"),
        ("a:x=(b:c=1", 4, "expected ')' to close"),
        ("a:x=[1,2", 4, "expected ']' to close"),
        ("a:x='ab", 4, "unterminated quoted text"),
        ("a b", 2, "expected ',', '+' or the end"),
        ("a:x=1)", 5, "a ')' without its '('"),
        ("1a", 0, "expected a name"),
        ("a:x=(b),5", 8, "expected key=value"),
        ("a:x=1,2,y=3,4=5", 13, "keys are words"),
        ("a:x=[b:c]", 5, "write a nested spec in parentheses"),
        ("a+", 2, "expected a name"),
    ],
)
def test_syntax_errors_name_the_position_and_what_was_expected(text, position, words):
    with pytest.raises(SpecError) as e:
        parse(text)
    assert e.value.position == position and words in e.value.message, str(e.value)
    assert isinstance(e.value, ValueError) and text in str(e.value) and "^" in str(e.value)


# text values, with the ones that look like another kind of value or hold grammar characters
TEXT = st.text(max_size=8) | st.sampled_from(
    [
        "none",
        "None",
        "true",
        "False",
        "inf",
        "-inf",
        "nan",
        "NaN",
        "12",
        "-3",
        "1e",
        "1e+3",
        ".5",
        "a b",
        "'",
        '"',
        "\\",
        "a,b",
        "x=y",
        "(",
        "]",
        "+",
        ":",
        "",
        "sqrt-islands",
        "a.b",
        "_",
        "a*b",
    ]
)
NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,5}", fullmatch=True)
KEYS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_\-]{0,5}", fullmatch=True)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | TEXT


def _make(name, args, positional, chain) -> Spec:
    return Spec(
        name, {**args, **({POSITIONAL: positional[0]} if positional else {}), **({CHAIN: chain[0]} if chain else {})}
    )


def _specs_of(values, chains):
    return st.builds(_make, NAMES, st.dictionaries(KEYS, values, max_size=3), st.lists(values, max_size=1), chains)


_FLAT = _specs_of(SCALARS, st.just([]))
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3).map(tuple) | _specs_of(inner, st.lists(_FLAT, max_size=1)),
    max_leaves=8,
)
ANY_SPEC = st.recursive(
    _specs_of(VALUES, st.just([])), lambda inner: _specs_of(VALUES, st.lists(inner, max_size=1)), max_leaves=4
)


@settings(max_examples=300, deadline=None)
@given(ANY_SPEC)
def test_any_spec_survives_format_then_parse(spec):
    text = format(spec)
    assert parse(text) == spec, text
    assert format(parse(text)) == text
    assert Spec.from_json(json.loads(json.dumps(spec.to_json()))) == spec


def test_json_form_round_trips_through_json_text():
    s = parse("diloco:compressor=(powersgd:rank=4),aggregator=(nnm+krum:f=1),x=[1,'a',none],y=-0.0,z=nan")
    j = s.to_json()
    assert j["args"]["compressor"] == {"name": "powersgd", "args": {"rank": 4}}
    assert Spec.from_json(json.loads(json.dumps(j))) == s
    assert Spec.from_json("powersgd:rank=4") == parse("powersgd:rank=4")  # text in a config still reads
    with pytest.raises(SpecError, match="name"):
        Spec.from_json({"args": {}})


def test_choice_takes_a_word_or_a_number():
    assert choice("auto", ["auto"]) == "auto" and choice("4", ["auto"]) == 4 and choice(8, ["auto"]) == 8
    assert choice("0.5", ["auto"], number=float) == 0.5
    for bad in ("fast", "2.5", True):
        with pytest.raises(SpecError, match="'auto' or int"):
            choice(bad, ["auto"], what="microbatches")


# ---- a registry, on types of this test ------------------------------------------------------------------------


class Shape:
    pass


class Circle(Shape):
    """A round shape. More text that the help line leaves out.

    `radius`: how far the edge is from the centre; `filled`: paint the inside."""

    def __init__(self, radius: float = 1.0, filled: bool = False, seed: int = 0):
        if radius <= 0:
            raise ValueError(f"radius must be > 0, got {radius}")
        self.radius, self.filled, self.seed = radius, filled, seed


class Square(Shape):
    def __init__(self, side: int, label: str | None = None, tags: tuple[str, ...] = ()):
        """A square of `side` units; `label`: its caption; `tags`: words attached to it."""
        self.side, self.label, self.tags = side, label, tags


class Stacked(Shape):
    """One shape on another: `inner` the one below, `gap` units between them."""

    def __init__(self, inner: Shape, gap: int = 0):
        self.inner, self.gap = inner, gap


class Picture:
    """A picture: `shape` drawn in `mode`, with a `size`."""

    def __init__(
        self,
        canvas: object,
        shape: Shape | None = None,
        mode: Literal["ink", "paint"] = "ink",
        seed: int = 0,
        palette: object = None,
    ):
        self.canvas, self.shape, self.mode, self.seed, self.palette = canvas, shape, mode, seed, palette


SHAPES = Registry(
    "shape",
    {
        "circle": Circle,
        "square": Square,
        "stacked": Stacked,
        "dot": bind(Circle, 0.1, doc="A small filled circle: a dot."),
    },
    base=Shape,
    aliases={"r": "radius"},
)
PICTURES = Registry("picture", {"picture": Picture}, shared={"picture": {"shape": ("seed",)}})


def test_check_normalises_names_aliases_and_values():
    assert SHAPES.check("Circle:r=2,filled=1") == Spec("circle", {"radius": 2.0, "filled": True})
    assert SHAPES.check("square:3,tags=round") == Spec("square", {"side": 3, "tags": ("round",)})
    assert SHAPES.check("square:side=3,label=none") == Spec("square", {"side": 3, "label": None})
    chained = Spec("stacked", {CHAIN: Spec("circle")})
    assert SHAPES.check("stacked:inner=(circle)") == SHAPES.check("stacked+circle") == chained
    assert format(SHAPES.check("stacked:gap=1,inner=(stacked+dot)")) == "stacked:gap=1+stacked+dot"
    pic = PICTURES.check("picture:shape=circle,mode=paint", supplied=["canvas"])
    assert pic == Spec("picture", {"shape": Spec("circle"), "mode": "paint"})
    assert PICTURES.check(pic, supplied=["canvas"]) == pic  # idempotent
    assert SHAPES.check({"name": "circle", "args": {"r": 3}}) == SHAPES.check("circle:radius=3")


@pytest.mark.parametrize(
    "text, words",
    [
        ("circel", ["unknown shape 'circel'", "did you mean 'circle'", "circle, square, stacked, dot"]),
        ("circle:radious=2", ["shape circle does not take radious", "did you mean radius", "radius, filled, seed"]),
        ("square", ["shape square needs side=<int>", "write square:side=<int>"]),
        ("square:side=2.5", ["side=2.5 is not a valid int"]),
        ("circle:filled=2", ["filled=2 is not a valid true|false"]),
        ("square:side=[1,2]", ["side=[1,2] is not a valid int"]),
        ("circle:radius=(square)", ["radius=(square) is not a valid float"]),
        ("stacked", ["needs the shape it feeds after a '+'", "stacked:gap=0+<shape>"]),
        ("circle+square:side=1", ["'circle' takes no shape to chain with '+'", "only stacked"]),
        ("circle:2,radius=3", ["radius is given twice (the value without a key is it)"]),
        ("circle:r=2,radius=3", ["radius is given twice (r is another name for it)"]),
        ("dot:0.5", ["the value 0.5 given without a key is its first parameter, filled", "write key=value"]),
        ("", ["non-empty"]),
    ],
)
def test_check_errors_say_what_is_wrong_and_what_would_be_right(text, words):
    with pytest.raises(SpecError) as e:
        SHAPES.check(text)
    for w in words:
        assert w in str(e.value), f"{w!r} not in: {e.value}"


def test_nested_errors_name_the_outer_parameter():
    with pytest.raises(SpecError) as e:
        PICTURES.check("picture:shape=(sqare:side=1)", supplied=["canvas"])
    assert "picture picture, shape: unknown shape 'sqare'" in str(e.value) and "did you mean 'square'" in str(e.value)
    with pytest.raises(SpecError) as e:
        PICTURES.check("picture:mode=oil", supplied=["canvas"])
    assert "mode=oil is not a valid ink | paint" in str(e.value)
    with pytest.raises(TypeError, match="a shape spec is text"):
        SHAPES.check(3)


def test_build_makes_the_objects_and_passes_context_and_shared_values():
    s = SHAPES.build("stacked:gap=2+stacked+circle:r=3,filled=true")
    assert isinstance(s, Stacked) and s.gap == 2 and isinstance(s.inner.inner, Circle)
    assert (s.inner.inner.radius, s.inner.inner.filled) == (3.0, True)
    assert SHAPES.build("dot").radius == 0.1  # bind: the fixed argument
    assert SHAPES.build("circle", radius=5.0).radius == 5.0  # context fills what the spec did not give ...
    assert SHAPES.build("circle:radius=2", radius=5.0).radius == 2.0  # ... and only that
    pic = PICTURES.build("picture:shape=(circle),seed=7", canvas="c")
    assert pic.canvas == "c" and pic.shape.seed == 7  # the picture's seed is its shape's context
    assert PICTURES.build("picture:shape=(circle:seed=1),seed=7", canvas="c").shape.seed == 1  # the shape's own wins
    with pytest.raises(SpecError, match="needs canvas, which the caller supplies"):
        PICTURES.build("picture")
    with pytest.raises(SpecError, match=r"shape circle:radius=-1.0: radius must be > 0, got -1.0"):
        SHAPES.build("circle:radius=-1")


def test_schema_and_describe_come_from_signatures_and_docstrings():
    params = {p.name: p for p in SHAPES.schema("circle")}
    assert list(params) == ["radius", "filled", "seed"]
    assert (params["radius"].type, params["radius"].default, params["radius"].required) == (float, 1.0, False)
    assert params["radius"].help == "how far the edge is from the centre"
    sq = {p.name: p for p in SHAPES.schema("square")}
    assert sq["side"].required and sq["label"].type == str | None and sq["tags"].help == "words attached to it"
    assert [p.name for p in PICTURES.schema("picture")] == ["shape", "mode", "seed"]  # canvas, palette: no spec form
    assert [p.name for p in SHAPES.schema("dot")] == ["filled", "seed"]
    text = SHAPES.describe()
    assert "circle:radius=1.0,filled=false,seed=0" in text and "A round shape." in text
    assert "More text" not in text and "A small filled circle: a dot." in text
    assert "stacked:gap=0+<shape>" in text and "square:side=<int>,label=none,tags=[]" in text
    one = SHAPES.describe("circle")
    assert "radius (float; default 1.0): how far the edge is from the centre" in one
    assert "shape or none" in PICTURES.describe("picture") or "shape spec or none" in PICTURES.describe("picture")
    assert SHAPES.names() == ("circle", "square", "stacked", "dot") and "Circle" in SHAPES and "oval" not in SHAPES
    assert SHAPES.chaining() == ("stacked",)


# ---- every islands registry -----------------------------------------------------------------------------------


def test_every_registry_is_covered_here():
    ours = {id(r) for r in (SHAPES, PICTURES)}
    assert {id(r) for r in registries() if id(r) not in ours} <= {id(r) for r in ISLANDS_REGISTRIES}


def _needs_nesting(reg: Registry, name: str) -> bool:
    return any(p.required and all(o.kind == "class" for o in p.options) for p in reg.schema(name))


def _values(opts, depth: int):
    has_registry = any(o.registry() is not None for o in opts)
    out = []
    for o in opts:
        if o.kind == "int":
            out.append(st.integers(-(10**9), 10**9))
        elif o.kind == "float":
            out.append(st.floats(allow_nan=True, allow_infinity=True) | st.integers(-1000, 1000))
        elif o.kind == "bool":
            out.append(st.booleans() | st.sampled_from([0, 1]))
        elif o.kind == "str" and not has_registry:  # a word there names a spec
            out.append(TEXT)
        elif o.kind == "none":
            out.append(st.none())
        elif o.kind == "literal":
            out.append(st.sampled_from(o.values))
        elif o.kind == "tuple":
            if o.fixed:
                out.append(st.tuples(*[_values(i, depth) for i in o.item]))
            else:
                out.append(st.lists(_values(o.item, depth), max_size=3).map(tuple))
        elif o.kind == "class" and o.registry() is not None and depth < 2:
            out.append(random_specs(o.registry(), depth + 1))
    return st.one_of(out)


@st.composite
def random_specs(draw, reg: Registry, depth: int = 0) -> Spec:
    """Any spec the registry's schema allows (values of the right types, not necessarily ones that build), with
    the older spellings mixed in: alias keys, a value without a key, a+b."""
    names = [n for n in reg if depth < 2 or not _needs_nesting(reg, n)]
    name = draw(st.sampled_from(names))
    chain, first = reg.chain_param(name), reg.positional_param(name)
    olds = {new: old for old, new in reg.aliases.items()}
    args = {}
    for p in reg.schema(name):
        if not (p.required or draw(st.booleans())):
            continue
        value = draw(_values(p.options, depth))
        key = p.name
        if p is chain and isinstance(value, Spec) and draw(st.booleans()):
            key = CHAIN
        elif p is first and draw(st.booleans()):
            key = POSITIONAL
        elif p.name in olds and olds[p.name] not in {q.name for q in reg.schema(name)} and draw(st.booleans()):
            key = olds[p.name]
        args[key] = value
    return Spec(name, args)


@pytest.mark.parametrize("reg", ISLANDS_REGISTRIES, ids=lambda r: r.kind)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_specs_round_trip_through_text_and_check(reg, data):
    raw = data.draw(random_specs(reg))
    assert parse(format(raw)) == raw
    assert Spec.from_json(json.loads(json.dumps(raw.to_json()))) == raw
    checked = reg.check(raw)
    assert reg.check(parse(format(raw))) == checked
    assert parse(format(checked)) == checked and reg.check(checked) == checked
    assert reg.check(format(checked)) == checked  # the canonical text reads back through the registry


# A value for each required parameter the schema cannot default (and attacks' which-ranks choice).
REQUIRED = {"f": 2, "m": 2, "s": 2, "factor": -2.0, "delay": 0.0, "min_params": 64, "units": 2, "switch": 3}


def _default_specs(reg: Registry, depth: int = 0):
    """Specs that give any subset of an entry's parameters explicitly, each at its default value."""

    @st.composite
    def draw_one(draw) -> Spec:
        names = [n for n in reg if depth < 2 or not _needs_nesting(reg, n)]
        name = draw(st.sampled_from(names))
        args = {}
        for p in reg.schema(name):
            if p.required:
                if p is reg.chain_param(name):
                    args[CHAIN] = draw(_default_specs(reg, depth + 1))
                else:
                    args[p.name] = REQUIRED[p.name]
            elif draw(st.booleans()):
                args[p.name] = p.default
        if reg is ATTACKS and name != "none":  # say which ranks attack (Byzantine needs count or ranks)
            args["count"] = 1
            args.pop("ranks", None)
        if reg is AGGREGATORS and name == "nnm":  # nnm's default f is the chain's last f, which may have none
            args["f"] = 2
        return Spec(name, args)

    return draw_one()


@pytest.mark.parametrize("reg", ISLANDS_REGISTRIES, ids=lambda r: r.kind)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_entry_builds_with_its_defaults_given_explicitly(reg, data):
    spec = data.draw(_default_specs(reg))
    built = reg.build(spec)
    assert (built is None) == (reg is ATTACKS and spec.name == "none")
    assert reg.build(format(reg.check(spec))).__class__ is built.__class__


def test_every_registry_describes_every_entry():
    for reg in ISLANDS_REGISTRIES:
        text = reg.describe()
        for name in reg:
            assert reg.usage(name) in text and reg.help(name), (reg.kind, name)
