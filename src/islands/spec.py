"""The one string grammar of islands: `name[:key=value,...]`, parsed once at the edge into a `Spec` value.

    parse("diloco:inner_steps=100,compressor=(powersgd:rank=4)")
      == Spec("diloco", {"inner_steps": 100, "compressor": Spec("powersgd", {"rank": 4})})

Grammar (whitespace between tokens is ignored):

    spec   := name [':' arg (',' arg)*] ['+' spec]
    arg    := key '=' value | value
    value  := int | float | true | false | none | word | 'text' | "text"
            | '(' spec ')' | '[' [value (',' value)*] ']'

- Words are text (`exp`, `sqrt-islands`); quote text that holds grammar characters or reads as a number.
  Floats take exponents (`1e-3`), and `inf`, `-inf`, `nan`.
- A value without a key, first in the list, is the entry's first parameter (`params:4096`, `split:4`).
- `a+b` is "a, whose one parameter of its own kind is b" (`nnm:f=1+krum:f=1`, `bucketing:s=2+median`); the
  Spec keeps it under the reserved key CHAIN so that `format` writes it back as `a+b`.
- Two older forms are still read: a bare value after `key=value` extends that value to a list
  (`ranks=1,5` is `ranks=[1,5]`), and a nested spec after `key=` may go without parentheses
  (`topology=random:s=2`); it then runs to the end of the list, or, when the caller says which keys belong to
  the outer entry (`parse(text, keys=...)`, as `Registry.check` does), up to the next such key.
  `format` always writes the canonical form: lists in brackets, nested specs in parentheses.

`format(spec)` writes the canonical text and `parse(format(s)) == s` for every Spec. `Spec.to_json()` is the
value as it travels in the job JSON.

A `Registry` names the constructors of one kind of component (compressors, aggregators, ...). The signature of
each constructor is its schema: parameter names, types from the annotations, defaults from the signature (the
one copy of each default), help from the docstrings (the first sentence for the entry, the clause naming
`param` for a parameter). `check` normalises a spec against that schema, `build` makes the object. A registry
given a `base` type resolves parameters annotated with that type: `DiLoCo(compressor: Compressor | None)` takes
`compressor=(powersgd:rank=4)`, checked and built by the compressor registry.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import functools
import inspect
import math
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar

POSITIONAL = "*"  # reserved key: a value given without a key (the entry's first parameter)
CHAIN = "+"  # reserved key: what follows '+' (a+b)

_SPECIAL = set(":,=+()[]'\"\\")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_INT = re.compile(r"-?[0-9]+\Z")
_FLOAT = re.compile(r"-?([0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)([eE][-+]?[0-9]+)?\Z")
_MANTISSA_E = re.compile(r"-?([0-9]+\.?[0-9]*|\.[0-9]+)[eE]\Z")  # "1e" in "1e+3": the '+' belongs to the number
_NEXT_KEY = re.compile(r",\s*([A-Za-z_][A-Za-z0-9_\-]*)\s*=")
_BARE = re.compile(r"[A-Za-z_][^\s:,=+()\[\]'\"\\]*\Z")  # text `format` may write without quotes
_WORDS: dict[str, Any] = {
    "true": True,
    "false": False,
    "none": None,
    "inf": math.inf,
    "-inf": -math.inf,
    "nan": math.nan,
}


class SpecError(ValueError):
    """A spec that does not parse or does not fit its registry; says what is wrong and what would be right."""

    def __init__(self, message: str, text: str | None = None, position: int | None = None):
        self.message, self.text, self.position = message, text, position
        if text is not None and position is not None:
            message = f"{message} (at position {position})\n    {text}\n    {' ' * position}^"
        super().__init__(message)


# -- the value ---------------------------------------------------------------------------------------------------


def _arg_order(item: tuple[str, Any]) -> tuple[int, str]:
    key = item[0]
    return (0 if key == POSITIONAL else 2 if key == CHAIN else 1, key)


def _as_value(v: Any, where: str) -> Any:
    if v is None or isinstance(v, (bool, int, float, str, Spec)):
        return v
    if isinstance(v, (tuple, list)):
        return tuple(_as_value(x, where) for x in v)
    raise TypeError(f"{where}: a spec value is an int, float, bool, None, str, tuple or Spec; got {type(v).__name__}")


def _tagged(v: Any) -> Any:
    """A key that tells 1, 1.0 and True apart (Python's == does not), and lets nan equal itself."""
    if isinstance(v, bool):
        return ("b", v)
    if isinstance(v, int):
        return ("i", v)
    if isinstance(v, float):
        return ("f", repr(v))
    if isinstance(v, str):
        return ("s", v)
    if v is None:
        return ("n",)
    if isinstance(v, tuple):
        return ("t", tuple(_tagged(x) for x in v))
    return ("S", v._key())


@dataclasses.dataclass(frozen=True, eq=False)
class Spec:
    """A parsed spec: an entry name and its arguments, in canonical order. A value: hashable, equal by value.

    `args` may be given as a mapping or as (key, value) pairs; values are int, float, bool, None, str, tuples of
    values, or nested Specs. `Spec("krum", {"f": 1})`.
    """

    name: str
    args: tuple[tuple[str, Any], ...] = ()  # canonical: sorted pairs of checked values (the constructor makes it)

    def __init__(self, name: str, args: Mapping[str, Any] | Iterable[tuple[str, Any]] = ()) -> None:
        # explicit (the dataclass keeps it): `args` is taken as a mapping or pairs but stored as the canonical tuple
        object.__setattr__(self, "name", name)
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise SpecError(f"a spec name is a word such as 'powersgd' (letters, digits, _ . -); got {name!r}")
        pairs = args.items() if isinstance(args, Mapping) else args
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if not isinstance(key, str) or not (key in (POSITIONAL, CHAIN) or _KEY.fullmatch(key)):
                raise SpecError(f"{name}: a parameter name is a word such as 'rank'; got {key!r}")
            if key in seen:
                raise SpecError(f"{name}: {key} is given twice")
            if key == CHAIN and not isinstance(value, Spec):
                raise SpecError(f"{name}: what follows '+' is a spec, got {value!r}")
            seen[key] = _as_value(value, f"{name}: {key}")
        object.__setattr__(self, "args", tuple(sorted(seen.items(), key=_arg_order)))

    def _key(self) -> tuple:
        return (self.name, tuple((k, _tagged(v)) for k, v in self.args))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Spec) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __str__(self) -> str:
        return format(self)

    def __contains__(self, key: str) -> bool:
        return any(k == key for k, _ in self.args)

    def __getitem__(self, key: str) -> Any:
        for k, v in self.args:
            if k == key:
                return v
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        for k, v in self.args:
            if k == key:
                return v
        return default

    def to_json(self) -> dict:
        """{"name": ..., "args": {...}}: tuples become lists, nested specs nested dicts of the same shape."""
        return {"name": self.name, "args": {k: _to_json(v) for k, v in self.args}}

    @staticmethod
    def from_json(obj: Any) -> Spec:
        """The inverse of to_json; spec text (a config written before specs travelled as JSON) is parsed."""
        if isinstance(obj, Spec):
            return obj
        if isinstance(obj, str):
            return parse(obj)
        if not isinstance(obj, Mapping) or "name" not in obj or set(obj) - {"name", "args"}:
            raise SpecError(f"a spec in JSON is {{'name': ..., 'args': {{...}}}} or spec text; got {obj!r}")
        args = obj.get("args") or {}
        if not isinstance(args, Mapping):
            raise SpecError(f"spec {obj['name']!r}: 'args' must be an object, got {args!r}")
        return Spec(obj["name"], {k: _from_json(v) for k, v in args.items()})


def _to_json(v: Any) -> Any:
    if isinstance(v, Spec):
        return v.to_json()
    if isinstance(v, tuple):
        return [_to_json(x) for x in v]
    return v


def _from_json(v: Any) -> Any:
    if isinstance(v, Mapping):
        return Spec.from_json(v)
    if isinstance(v, list):
        return tuple(_from_json(x) for x in v)
    return v


# -- text -> Spec ------------------------------------------------------------------------------------------------


def _atom_value(raw: str) -> Any:
    low = raw.lower()
    if low in _WORDS:
        return _WORDS[low]
    if _INT.match(raw):
        return int(raw)
    if _FLOAT.match(raw):
        return float(raw)
    return raw


class _Parser:
    def __init__(self, text: str, keys: Callable[[str], Iterable[str] | None] | None):
        self.text, self.i, self.keys = text, 0, keys

    def fail(self, message: str, at: int | None = None) -> typing.NoReturn:
        raise SpecError(message, self.text, self.i if at is None else at)

    def peek(self) -> str:
        while self.i < len(self.text) and self.text[self.i].isspace():
            self.i += 1
        return self.text[self.i] if self.i < len(self.text) else ""

    def spec(self, depth: int, stop: frozenset | None = None) -> Spec:
        """name [':' args] ['+' spec]. `stop`: keys that end the argument list of an unparenthesised nested
        spec (legacy), None to run to the end of the list."""
        self.peek()
        m = _NAME.match(self.text, self.i)
        if not m:
            self.fail("expected a name (a word such as 'powersgd')")
        name, start = m.group(), self.i
        self.i = m.end()
        args: list[tuple[str, Any]] = []
        if self.peek() == ":":
            self.i += 1
            own = None
            if depth == 0 and self.keys is not None:
                own = frozenset(self.keys(name) or ())
            args = self.arglist(name, stop, own)
        if self.peek() == "+":
            self.i += 1
            args.append((CHAIN, self.spec(depth, stop)))
        try:
            return Spec(name, args)
        except SpecError as e:
            self.fail(e.message, start)

    def arglist(self, name: str, stop: frozenset | None, own: frozenset | None) -> list[tuple[str, Any]]:
        """key=value pairs up to the end of the list. `own`: this entry's keys (top level, when the caller
        gave them), which end the unparenthesised nested values inside it."""
        args: dict[str, Any] = {}
        extendable: str | None = None  # the key a value without key extends (legacy `ranks=1,5`)
        while True:
            self.peek()
            at = self.i
            key = self.key()
            if key is not None:
                if key in args:
                    self.fail(f"{name}: {key} is given twice", at)
                args[key] = self.value(nested_stop=own if own is not None else stop, keyed=True)
                extendable = key if not isinstance(args[key], (Spec, tuple)) else None
            elif not args:
                args[POSITIONAL] = self.value(nested_stop=None, keyed=False)
                extendable = POSITIONAL if not isinstance(args[POSITIONAL], (Spec, tuple)) else None
            elif extendable is not None:
                prev = args[extendable]
                extra = self.value(nested_stop=None, keyed=False)
                args[extendable] = (prev if isinstance(prev, tuple) else (prev,)) + (extra,)
            else:
                self.fail(
                    f"{name}: expected key=value (a value without a key may come first, as the first "
                    f"parameter, or follow a plain key=value as more items of it)"
                )
            if self.peek() != ",":
                return list(args.items())
            if stop is not None:
                m = _NEXT_KEY.match(self.text, self.i)
                if m and m.group(1) in stop:
                    return list(args.items())  # that key belongs to the entry outside this nested spec
            self.i += 1

    def key(self) -> str | None:
        m = _KEY.match(self.text, self.i)
        if not m:
            return None
        j = m.end()
        while j < len(self.text) and self.text[j].isspace():
            j += 1
        if j < len(self.text) and self.text[j] == "=":
            self.i = j + 1
            return m.group()
        return None

    def value(self, nested_stop: frozenset | None, keyed: bool) -> Any:
        c = self.peek()
        start = self.i
        if c == "(":
            self.i += 1
            inner = self.spec(depth=1)
            if self.peek() != ")":
                self.fail(
                    "expected ')' to close this '('"
                    if not self.peek()
                    else "expected ')' or ',' and the next key=value of the nested spec",
                    start if not self.peek() else None,
                )
            self.i += 1
            return inner
        if c == "[":
            self.i += 1
            items: list[Any] = []
            if self.peek() != "]":
                while True:
                    items.append(self.value(nested_stop=None, keyed=False))
                    if self.peek() != ",":
                        break
                    self.i += 1
            if self.peek() != "]":
                self.fail(
                    "expected ']' to close this '['" if not self.peek() else "expected ',' or ']'",
                    start if not self.peek() else None,
                )
            self.i += 1
            return tuple(items)
        if c in ("'", '"'):
            return self.quoted(c)
        raw = self.atom()
        if not raw:
            got = "the end" if not c else repr(c)
            self.fail(f"expected a value (a number, a word, 'quoted text', (nested:spec) or [list]); got {got}")
        if self.i < len(self.text) and self.text[self.i] == ":":
            if not keyed or not _NAME.fullmatch(raw):
                self.fail(f"write a nested spec in parentheses: ({raw}:...)", start)
            self.i = start  # a nested spec without parentheses (the older form)
            return self.spec(depth=1, stop=nested_stop)
        return _atom_value(raw)

    def atom(self) -> str:
        j, text = self.i, self.text
        while j < len(text):
            ch = text[j]
            if ch.isspace() or ch in _SPECIAL:
                if ch == "+" and _MANTISSA_E.match(text, self.i, j):
                    j += 1  # the sign of an exponent: 1e+3
                    continue
                break
            j += 1
        raw, self.i = text[self.i : j], j
        return raw

    def quoted(self, quote: str) -> str:
        start = self.i
        self.i += 1
        out = []
        while self.i < len(self.text):
            ch = self.text[self.i]
            if ch == "\\" and self.i + 1 < len(self.text):
                out.append(self.text[self.i + 1])
                self.i += 2
                continue
            if ch == quote:
                self.i += 1
                return "".join(out)
            out.append(ch)
            self.i += 1
        self.fail(f"unterminated quoted text: add the closing {quote}", start)


def parse(text: str, keys: Callable[[str], Iterable[str] | None] | None = None) -> Spec:
    """Spec text -> Spec, purely syntactic; SpecError names the position and what was expected there.

    `keys(name)`, when given, lists the parameters of the top-level entry `name`: an unparenthesised nested value
    (`compress=topk:ratio=0.01,seed=3`) then ends before the next of those keys instead of at the end of the list.
    """
    if not isinstance(text, str):
        raise TypeError(f"spec text must be a str such as 'powersgd:rank=4', got {type(text).__name__}")
    p = _Parser(text, keys)
    if not p.peek():
        raise SpecError("empty spec: expected a name such as 'powersgd' or 'diloco:inner_steps=100'", text, 0)
    spec = p.spec(depth=0)
    c = p.peek()
    if c:
        hint = {
            ")": "a ')' without its '('",
            "]": "a ']' without its '['",
            "=": "keys are words such as rank, before the =",
        }
        p.fail(f"unexpected {c!r}: expected ',', '+' or the end" + (f" ({hint[c]})" if c in hint else ""))
    return spec


# -- Spec -> text ------------------------------------------------------------------------------------------------


def _format_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else "inf" if v == math.inf else "-inf" if v == -math.inf else repr(v)
    if isinstance(v, str):
        if _BARE.match(v) and v.lower() not in _WORDS:
            return v
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(v, tuple):
        return "[" + ",".join(_format_value(x) for x in v) + "]"
    if isinstance(v, Spec):
        return "(" + format(v) + ")"
    raise TypeError(f"not a spec value: {v!r}")


def format(spec: Spec) -> str:  # (shadows the builtin on purpose) the module's verb, as in spec.parse / spec.format
    """The canonical text of a Spec: keys sorted, lists in brackets, nested specs in parentheses."""
    if not isinstance(spec, Spec):
        raise TypeError(f"format takes a Spec, got {type(spec).__name__}")
    parts, chain = [], None
    for key, value in spec.args:
        if key == CHAIN:
            chain = value
        elif key == POSITIONAL:
            parts.append(_format_value(value))
        else:
            parts.append(f"{key}={_format_value(value)}")
    text = spec.name + (":" + ",".join(parts) if parts else "")
    return text + ("+" + format(chain) if chain is not None else "")


# -- types: what a parameter annotation accepts ------------------------------------------------------------------

_KINDS: dict[Any, Registry] = {}  # base type -> the registry that builds it
_ALL: list[Registry] = []


def registries() -> tuple[Registry, ...]:
    """Every registry made so far, in order (for --help listings and the round-trip tests)."""
    return tuple(_ALL)


def registry_for(tp: Any) -> Registry | None:
    """The registry registered for a base type (Registry(..., base=tp)), if any."""
    try:
        return _KINDS.get(tp)
    except TypeError:  # unhashable annotation
        return None


@dataclasses.dataclass(frozen=True)
class _Opt:
    """One alternative of an annotation: int, float, bool, str, none, any, literal, tuple, or a class."""

    kind: str
    values: tuple = ()  # literal: the allowed values
    item: tuple = ()  # tuple: the options of each item (variadic), or of each position (fixed)
    fixed: bool = False
    cls: Any = None

    def registry(self) -> Registry | None:
        return registry_for(self.cls) if self.kind == "class" else None

    def spellable(self) -> bool:
        if self.kind == "class":
            return self.registry() is not None
        if self.kind == "tuple":
            items = self.item if self.fixed else (self.item,)
            return all(any(o.spellable() for o in opts) for opts in items)
        return self.kind != "none"


_SIMPLE = {bool: "bool", int: "int", float: "float", str: "str", type(None): "none"}


def _options(tp: Any) -> tuple[_Opt, ...]:
    if tp is inspect.Parameter.empty or tp is Any:
        return (_Opt("any"),)
    if tp is None:
        return (_Opt("none"),)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        return tuple(o for a in args for o in _options(a))
    if origin is typing.Annotated:
        return _options(args[0])
    if origin is typing.Literal:
        return (_Opt("literal", values=tuple(args)),)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return (_Opt("tuple", item=_options(args[0])),)
        if args == ((),) or not args:
            return (_Opt("tuple", item=(_Opt("any"),)),)
        return (_Opt("tuple", item=tuple(_options(a) for a in args), fixed=True),)
    if origin in (list, collections.abc.Sequence, collections.abc.Iterable, collections.abc.Collection):
        return (_Opt("tuple", item=_options(args[0]) if args else (_Opt("any"),)),)
    if tp in (tuple, list):
        return (_Opt("tuple", item=(_Opt("any"),)),)
    if tp in _SIMPLE:
        return (_Opt(_SIMPLE[tp]),)
    return (_Opt("class", cls=tp),)


def _opt_text(o: _Opt) -> str:
    if o.kind == "literal":
        return " | ".join(_format_value(v) for v in o.values)
    if o.kind == "tuple":
        if o.fixed:
            return "[" + ", ".join(_type_text(opts) for opts in o.item) + "]"
        return f"[{_type_text(o.item)}, ...]"
    if o.kind == "class":
        reg = o.registry()
        return f"{reg.kind} spec" if reg else getattr(o.cls, "__name__", str(o.cls))
    return {"bool": "true|false", "str": "text", "any": "value"}.get(o.kind, o.kind)


def _type_text(opts: tuple[_Opt, ...]) -> str:
    shown = [o for o in opts if o.spellable() or o.kind == "any"]
    if any(o.kind == "none" for o in opts):
        shown.append(_Opt("none"))
    return " or ".join(dict.fromkeys(_opt_text(o) for o in shown)) or "value"


class _Mismatch(Exception):
    """A value that does not fit an annotation (turned into a SpecError naming the parameter)."""


def _coerce(value: Any, opts: tuple[_Opt, ...]) -> Any:
    kinds = {o.kind for o in opts}
    literals = [v for o in opts if o.kind == "literal" for v in o.values]
    specs = [r for o in opts if o.kind == "class" and (r := o.registry()) is not None]
    if "any" in kinds and not isinstance(value, Spec):
        return value
    if value is None:
        if "none" in kinds:
            return None
        if "none" in literals or "str" in kinds:
            return "none"  # the word none, for a parameter that takes text
        raise _Mismatch()
    if isinstance(value, bool):
        if "bool" in kinds or any(type(v) is bool and v == value for v in literals):
            return value
    elif isinstance(value, int):
        if "int" in kinds or any(type(v) is int and v == value for v in literals):
            return value
        if "float" in kinds:
            return float(value)
        if "bool" in kinds and value in (0, 1):
            return bool(value)  # ef=0 / ef=1
    elif isinstance(value, float):
        if "float" in kinds or any(type(v) is float and v == value for v in literals):
            return value
    elif isinstance(value, str):
        if value in literals:
            return value
        if specs and _NAME.fullmatch(value):
            return _check_nested(Spec(value), specs)
        if "str" in kinds:
            return value
    elif isinstance(value, Spec):
        if specs:
            return _check_nested(value, specs)
    elif isinstance(value, tuple):
        for o in opts:
            if o.kind == "tuple":
                if o.fixed:
                    if len(value) != len(o.item):
                        continue
                    return tuple(_coerce(v, item) for v, item in zip(value, o.item))
                return tuple(_coerce(v, o.item) for v in value)
        raise _Mismatch()
    for o in opts:  # one value where a list is expected: a list of one
        if o.kind == "tuple" and not o.fixed:
            return (_coerce(value, o.item),)
    raise _Mismatch()


def _check_nested(value: Spec, registries: list[Registry]) -> Spec:
    reg = next((r for r in registries if r.lookup(value.name) is not None), registries[0])
    return reg.check(value)


# -- the registry ------------------------------------------------------------------------------------------------


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter of a registry entry, read from the entry's signature and docstring."""

    REQUIRED: ClassVar[Any] = _Required()

    name: str
    type: Any  # the resolved annotation
    default: Any  # Param.REQUIRED when the signature has none
    required: bool
    help: str = ""
    options: tuple = dataclasses.field(default=(), repr=False, compare=False)
    spellable: bool = dataclasses.field(default=True, repr=False, compare=False)  # False: only the caller gives it
    positional_only: bool = dataclasses.field(default=False, repr=False, compare=False)

    @property
    def type_text(self) -> str:
        return _type_text(self.options)

    def usage(self) -> str:
        if self.required:
            return f"{self.name}=<{self.type_text}>"
        return f"{self.name}={_default_text(self.default)}"


def _default_text(v: Any) -> str:
    if isinstance(v, str) and _BARE.match(v):
        return v  # for reading: `none` given for a text parameter is the text "none"
    try:
        return _format_value(_as_value(v, "default"))
    except TypeError:
        return repr(v)


def bind(fn: Callable, /, *args: Any, doc: str | None = None, **kwargs: Any) -> functools.partial:
    """`fn` with some arguments fixed, as a registry entry: positional ones leave the schema, keyword ones set its
    default there (`bind(Cast, torch.float16)`, `bind(TopK, warmup=True)`); `doc` is the entry's own help."""
    entry = functools.partial(fn, *args, **kwargs)
    if doc is not None:
        entry.__doc__ = doc
    return entry


def _unwrap(fn: Any) -> Any:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def _own_doc(obj: Any) -> str:
    """A docstring written for obj itself (a dataclass's generated 'Name(field: type)' does not count)."""
    doc = (
        obj.__dict__.get("__doc__")
        if inspect.isclass(obj) or isinstance(obj, functools.partial)
        else getattr(obj, "__doc__", None)
    )
    if not doc or (inspect.isclass(obj) and doc.startswith(obj.__name__ + "(")):
        return ""
    return inspect.cleandoc(doc)


def docs_of(fn: Any) -> str:
    """The docstrings a Registry reads for an entry: its own, then (through `bind`) the callable's; for a class
    without one of its own, its module's (one concept per module), then its constructor's."""
    parts = []
    while isinstance(fn, functools.partial):
        parts.append(_own_doc(fn))
        fn = fn.func
    parts.append(_own_doc(fn))
    if inspect.isclass(fn):
        if not parts[-1]:
            module = sys.modules.get(fn.__module__)
            parts.append(inspect.cleandoc(module.__doc__ or "").split("\n\n")[0] if module else "")
        init = getattr(fn, "__init__", None)
        if init is not None and init is not object.__init__:
            parts.append(inspect.cleandoc(init.__doc__ or ""))
    return "\n\n".join(p for p in parts if p)


_CLAUSE = re.compile(r"(?<!e\.g\.)(?<!i\.e\.)(?<=[.;])\s+|\n\s*\n")
_SENTENCE = re.compile(r"(?<!e\.g\.)(?<!i\.e\.)(?<=\.)\s+")


def _param_help(doc: str, name: str) -> str:
    tick = f"`{name}`"
    for clause in _CLAUSE.split(doc):
        if tick in clause:
            text = " ".join(clause.split())
            if text.startswith(tick + ":"):
                text = text[len(tick) + 1 :].lstrip()
            text = text.replace("`", "")
            return text[:-1] if text.endswith((";", ".")) and not text.endswith("..") else text
    return ""


def _hints(fn: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Resolved annotations of fn's parameters (typing.get_type_hints) and the namespace to resolve the rest."""
    target = _unwrap(fn)
    sources = [target.__init__, target] if inspect.isclass(target) else [target]
    hints: dict[str, Any] = {}
    for src in sources:
        try:
            hints = {**typing.get_type_hints(src), **hints}
        except Exception:  # noqa: BLE001 - one unresolvable annotation: resolve the others one by one below
            pass
    module = sys.modules.get(getattr(target, "__module__", "") or "")
    return hints, dict(vars(module)) if module else {}


def _resolve(annotation: Any, name: str, hints: dict, namespace: dict) -> Any:
    if not isinstance(annotation, str):
        return hints.get(name, annotation) if annotation is inspect.Parameter.empty else annotation
    if name in hints:
        return hints[name]
    try:
        return eval(annotation, namespace, {})  # eval: an annotation string from our own source
    except Exception:  # noqa: BLE001 - unresolvable: a type with no spec form
        return object


def resolved_signature(fn: Callable) -> inspect.Signature:
    """fn's signature with its annotations resolved to types (what a Registry reads as the schema); for entries
    that add parameters to a constructor's (`inspect.Signature(params)` as the wrapper's `__signature__`)."""
    sig = inspect.signature(fn)
    hints, namespace = _hints(fn)
    return sig.replace(
        parameters=[
            p.replace(annotation=_resolve(p.annotation, p.name, hints, namespace)) for p in sig.parameters.values()
        ],
        return_annotation=inspect.Signature.empty,
    )


def _read_schema(fn: Callable) -> list[Param]:
    sig = resolved_signature(fn)
    doc = docs_of(fn)
    params = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        tp = p.annotation
        required = p.default is inspect.Parameter.empty
        default = Param.REQUIRED if required else p.default
        if tp is inspect.Parameter.empty and not required and type(default) in (bool, int, float, str):
            tp = type(default)  # unannotated: the default's type
        opts = _options(tp)
        spellable = any(o.spellable() or o.kind == "any" for o in opts if o.kind != "none")
        params.append(
            Param(p.name, tp, default, required, _param_help(doc, p.name), opts, spellable, p.kind == p.POSITIONAL_ONLY)
        )
    return params


class Registry:
    """The constructors of one kind of component by spec name; their signatures are the schema.

        COMPRESSORS = Registry("compressor", {"powersgd": PowerSGD, "fp16": bind(Cast, torch.float16)},
                               base=Compressor)
        COMPRESSORS.check("powersgd:rank=4") -> Spec  (normalised: aliases resolved, values typed)
        COMPRESSORS.build("powersgd:rank=4") -> PowerSGD(rank=4)

    `base`: the type (or types) the entries make; a parameter annotated with it (or `base | None`) anywhere is
    checked and built by this registry. `aliases`: {old_key: new_key}, for entries that have new_key and not
    old_key. `shared`: {entry: {param: (keys...)}}: the entry's values of `keys` are the context its nested
    `param` is built with (gossip's seed seeds its random topology).
    """

    def __init__(
        self,
        kind: str,
        entries: Mapping[str, Callable],
        base: type | tuple | None = None,
        aliases: Mapping[str, str] | None = None,
        shared: Mapping[str, Mapping[str, Iterable[str]]] | None = None,
    ):
        if not entries:
            raise ValueError(f"registry {kind!r} needs at least one entry")
        for name in entries:
            if not _NAME.fullmatch(name):
                raise ValueError(f"registry {kind!r}: entry name {name!r} is not a spec name (letters, digits, _ . -)")
        self.kind = kind
        self._entries = dict(entries)
        self._lower = {n.lower(): n for n in self._entries}
        self.aliases = dict(aliases or {})
        self.shared = {e: {p: tuple(ks) for p, ks in m.items()} for e, m in (shared or {}).items()}
        self._schemas: dict[str, list[Param]] = {}
        self.bases = tuple(base) if isinstance(base, tuple) else (base,) if base is not None else ()
        for b in self.bases:
            _KINDS[b] = self
        _ALL.append(self)

    # -- reading -------------------------------------------------------------------------------------------------
    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.lookup(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._entries)})"

    def lookup(self, name: str) -> str | None:
        """The entry's own spelling of `name` (names are matched without regard to case), or None."""
        return name if name in self._entries else self._lower.get(name.lower())

    def entry(self, name: str) -> Callable:
        return self._entries[self._known(name)]

    def _all_params(self, name: str) -> list[Param]:
        name = self._known(name)
        if name not in self._schemas:
            try:
                self._schemas[name] = _read_schema(self._entries[name])
            except (TypeError, ValueError) as e:
                raise TypeError(f"{self.kind} {name!r}: cannot read its signature ({e})") from None
        return self._schemas[name]

    def schema(self, name: str) -> list[Param]:
        """The parameters a spec of `name` may give, in signature order."""
        return [p for p in self._all_params(name) if p.spellable]

    def chain_param(self, name: str) -> Param | None:
        """The one parameter of the entry whose type is this registry's kind: the b of a+b (None: a takes no +)."""
        own = [p for p in self.schema(name) if any(o.registry() is self for o in p.options)]
        return own[0] if len(own) == 1 else None

    def chaining(self) -> tuple[str, ...]:
        """The entries that take a spec of this kind after a '+' (the aggregators' steps nnm, bucketing)."""
        return tuple(n for n in self._entries if self.chain_param(n) is not None)

    def positional_param(self, name: str) -> Param | None:
        """The parameter a value given without a key sets: the first one, the chained one aside."""
        chain = self.chain_param(name)
        rest = [p for p in self.schema(name) if p is not chain]
        return rest[0] if rest else None

    def usage(self, name: str) -> str:
        """One line: the entry with every parameter and its default (`<type>` where it has none)."""
        name = self._known(name)
        chain = self.chain_param(name)
        parts = [p.usage() for p in self.schema(name) if p is not chain]
        return name + (":" + ",".join(parts) if parts else "") + (f"+<{self.kind}>" if chain else "")

    def help(self, name: str) -> str:
        """The entry's help: the first sentence of its docstring."""
        doc = docs_of(self._entries[self._known(name)]).strip()
        first = " ".join(doc.split("\n\n")[0].split())
        return _SENTENCE.split(first)[0].replace("`", "") if first else ""

    def describe(self, name: str | None = None) -> str:
        """Help text: every entry on one line (name=None), or one entry with a line per parameter."""
        if name is None:
            lines = [f"valid {self.kind} specs (name[:key=value,...]):"]
            for n in self._entries:
                h = self.help(n)
                lines.append(f"  {self.usage(n)}" + (f"\n      {h}" if h else ""))
            return "\n".join(lines)
        name = self._known(name)
        lines = [self.usage(name)]
        if self.help(name):
            lines.append(f"  {self.help(name)}")
        for p in self.schema(name):
            when = "required" if p.required else f"default {_default_text(p.default)}"
            lines.append(f"  {p.name} ({p.type_text}; {when})" + (f": {p.help}" if p.help else ""))
        return "\n".join(lines)

    def _known(self, name: str) -> str:
        found = self.lookup(name) if isinstance(name, str) else None
        if found is None:
            close = difflib.get_close_matches(str(name).lower(), list(self._lower), n=1, cutoff=0.6)
            hint = f" (did you mean {self._lower[close[0]]!r}?)" if close else ""
            raise SpecError(f"unknown {self.kind} {name!r}{hint}; valid: {', '.join(self._entries)}\n{self.describe()}")
        return found

    def _keys(self, name: str) -> list[str] | None:
        found = self.lookup(name)
        if found is None:
            return None
        params = {p.name for p in self.schema(found)}
        return sorted(params | {old for old, new in self.aliases.items() if new in params and old not in params})

    # -- checking ------------------------------------------------------------------------------------------------
    def as_spec(self, spec: Spec | str | Mapping) -> Spec:
        if isinstance(spec, Spec):
            return spec
        if isinstance(spec, str):
            if not spec.strip():
                raise SpecError(f"a {self.kind} spec must be non-empty, e.g. {self.usage(next(iter(self._entries)))!r}")
            return parse(spec, keys=self._keys)
        if isinstance(spec, Mapping):
            return Spec.from_json(spec)
        raise TypeError(
            f"a {self.kind} spec is text such as {self.usage(next(iter(self._entries)))!r} or a Spec; "
            f"got {type(spec).__name__}"
        )

    def check(self, spec: Spec | str | Mapping, *, supplied: Iterable[str] = ()) -> Spec:
        """The spec normalised against the schema: the entry's own name, aliases resolved, values coerced to the
        annotated types, nested specs checked by their registries. `supplied`: parameters the caller gives at
        build time (not required in the spec)."""
        spec = self.as_spec(spec)
        name = self._known(spec.name)
        params = {p.name: p for p in self.schema(name)}
        chain = self.chain_param(name)
        supplied = set(supplied)
        out: dict[str, Any] = {}
        spelled: dict[str, str] = {}  # canonical key -> how the spec wrote it
        for key, value in spec.args:
            given_as = key
            if key == CHAIN:
                if chain is None:
                    chainers = self.chaining()
                    raise SpecError(
                        f"{name!r} takes no {self.kind} to chain with '+'; only "
                        f"{', '.join(chainers) or 'none'} do (a step must come before the "
                        f"{self.kind} it feeds)"
                    )
                key = chain.name
            elif key == POSITIONAL:
                first = self.positional_param(name)
                if first is None:
                    raise SpecError(
                        f"{self.kind} {name} takes no parameters, got the value "
                        f"{_format_value(value)}: write {self.usage(name)}"
                    )
                key = first.name
            elif key not in params:
                key = self._resolve_key(name, key, params)
            if key in out:
                ways = {spelled[key], given_as} - {key}
                why = (
                    ""
                    if not ways
                    else " (the value without a key is it)"
                    if POSITIONAL in ways
                    else f" ({ways.pop()} is another name for it)"
                )
                raise SpecError(f"{self.kind} {name}: {key} is given twice{why}")
            spelled[key] = given_as
            out[key] = self._coerce_arg(name, params[key], value, positional=given_as == POSITIONAL)
        for p in params.values():
            if p.required and p.name not in out and p.name not in supplied and p is chain:
                raise SpecError(
                    f"{self.kind} {name} needs the {self.kind} it feeds after a '+': write {self.usage(name)}"
                )
            if p.required and p.name not in out and p.name not in supplied:
                raise SpecError(f"{self.kind} {name} needs {p.name}=<{p.type_text}>: write {self.usage(name)}")
        if chain is not None and chain.name in out and isinstance(out[chain.name], Spec):
            out[CHAIN] = out.pop(chain.name)  # one canonical form: a+b
        return Spec(name, out)

    def _resolve_key(self, name: str, key: str, params: dict[str, Param]) -> str:
        new = self.aliases.get(key)
        if new in params and key not in params:
            return new
        if key.lower() in params:
            return key.lower()
        close = difflib.get_close_matches(key, list(params), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        listed = ", ".join(params) or "none"
        raise SpecError(
            f"{self.kind} {name} does not take {key}{hint}; its parameters: {listed}\n{self.describe(name)}"
        )

    def _coerce_arg(self, name: str, p: Param, value: Any, positional: bool) -> Any:
        where = f"{self.kind} {name}, {p.name}"
        try:
            return _coerce(value, p.options)
        except _Mismatch:
            shown = _format_value(value)
            if positional:
                raise SpecError(
                    f"{self.kind} {name}: the value {shown} given without a key is its first "
                    f"parameter, {p.name}, which takes {p.type_text}; write key=value "
                    f"({self.usage(name)})"
                ) from None
            raise SpecError(f"{self.kind} {name}: {p.name}={shown} is not a valid {p.type_text}") from None
        except SpecError as e:
            if e.message.startswith(where):
                raise
            raise SpecError(f"{where}: {e.message}") from None

    # -- building ------------------------------------------------------------------------------------------------
    def build(self, spec: Spec | str | Mapping, **context: Any) -> Any:
        """The object a spec names, nested specs built first. `context`: values for parameters the spec does not
        give (a default that depends on the job, or an argument with no spec form)."""
        return self._build(self.check(spec, supplied=context), context)

    def _build(self, spec: Spec, context: Mapping[str, Any]) -> Any:
        name = spec.name
        given = dict(spec.args)
        chain = self.chain_param(name)
        if CHAIN in given:
            assert chain is not None, "check() lets '+' through only for an entry with a chain parameter"
            given[chain.name] = given.pop(CHAIN)
        params = self._all_params(name)

        def plain(key: str) -> Any:
            if key in given:
                return given[key]
            if key in context:
                return context[key]
            p = next((p for p in params if p.name == key), None)
            return None if p is None or p.required else p.default

        args, kwargs = [], {}
        for p in params:
            if p.name in given:
                shared = {k: plain(k) for k in self.shared.get(name, {}).get(p.name, ())}
                value = _materialise(given[p.name], p.options, shared)
            elif p.name in context:
                value = context[p.name]
            elif p.required:
                raise SpecError(f"{self.kind} {name} needs {p.name}, which the caller supplies (it has no spec form)")
            else:
                continue
            if p.positional_only:
                args.append(value)
            else:
                kwargs[p.name] = value
        try:
            return self._entries[name](*args, **kwargs)
        except ValueError as e:
            raise SpecError(f"{self.kind} {format(spec)}: {e}") from e


def _materialise(value: Any, opts: tuple[_Opt, ...], context: Mapping[str, Any]) -> Any:
    if isinstance(value, Spec):
        for o in opts:
            reg = o.registry()
            if reg is not None and reg.lookup(value.name) is not None:
                return reg._build(value, context)
        raise SpecError(f"no registry builds {format(value)!r}")  # check would have refused it
    if isinstance(value, tuple):
        items = [o for o in opts if o.kind == "tuple"]
        if items and not items[0].fixed:
            return tuple(_materialise(v, items[0].item, context) for v in value)
        if items:
            return tuple(_materialise(v, item, context) for v, item in zip(value, items[0].item))
    return value


# -- small choices ----------------------------------------------------------------------------------------------


def choice(value: Any, words: Iterable[str], number: type = int, what: str = "value") -> Any:
    """One of a few words or a number (`microbatches=auto|N`): the word, or the number as `number`."""
    words = tuple(words)
    parsed = _atom_value(value.strip()) if isinstance(value, str) else value
    if isinstance(parsed, str) and parsed in words:
        return parsed
    numeric = isinstance(parsed, (int, float)) and not isinstance(parsed, bool)
    if numeric and (number is float or isinstance(parsed, int)):
        return number(parsed)
    raise SpecError(f"{what} must be {' or '.join(repr(w) for w in words)} or {number.__name__}; got {value!r}")


__all__ = [
    "CHAIN",
    "POSITIONAL",
    "Param",
    "Registry",
    "Spec",
    "SpecError",
    "bind",
    "choice",
    "format",
    "parse",
    "docs_of",
    "registries",
    "registry_for",
    "resolved_signature",
]
