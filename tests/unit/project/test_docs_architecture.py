"""docs/architecture.md cannot go stale: every module, file and identifier it names in backticks exists.

The doc names code three ways: a dotted path (`islands.app.build.build_trainer`), a file path
(`sync/outer/eager.py`, `bench/islands_bench/harness.py`) or a bare identifier (`ElasticComm`,
`ElasticComm.share_state`). Each must resolve in the tree as it is; commands, spec strings and config
keys in backticks are not code and are left alone.
"""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
while not (ROOT / "pyproject.toml").exists():  # the test may live below tests/ (tests/unit/...)
    ROOT = ROOT.parent
DOC = ROOT / "docs" / "architecture.md"
SOURCES = [ROOT / "src" / "islands", ROOT / "bench" / "islands_bench"]

# Names in backticks that are not this project's code: what a run or a benchmark writes, and other projects' classes
NOT_OURS = {
    "run.json",
    "config.json",
    "result.json",
    "summary.md",  # files a run or an experiment writes
    "ModelOutput",  # transformers' model output class
    "islands.commands",  # the entry-point group `islands bench` is found through (bench/pyproject.toml)
}

_DOTTED = re.compile(r"^islands(_bench)?(\.[A-Za-z_][A-Za-z0-9_]*)+")
_FILE = re.compile(r"^[A-Za-z0-9_./-]+\.(py|md|toml|json|css|html|js)$")
_IDENT = re.compile(r"^[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*(\.[a-z_][A-Za-z0-9_]*)?$")  # CamelCase[.member]


def _spans() -> list[str]:
    text = DOC.read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # diagrams and shell blocks: not names
    return sorted(set(re.findall(r"`([^`\n]+)`", text)))


@cache
def _definitions() -> dict[str, set[str]]:
    """Every class and top-level name defined in the sources, with the members each class defines."""
    names: dict[str, set[str]] = {}
    for base in SOURCES:
        for path in base.rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    members = names.setdefault(node.name, set())
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                            members.add(item.name)
                        elif isinstance(item, ast.Assign):
                            members.update(t.id for t in item.targets if isinstance(t, ast.Name))
                        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                            members.add(item.target.id)
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.setdefault(node.name, set())
            for node in tree.body:
                targets = node.targets if isinstance(node, ast.Assign) else []
                names.update({t.id: set() for t in targets if isinstance(t, ast.Name) and t.id not in names})
    return names


def _resolve_dotted(span: str) -> bool:
    dotted = _DOTTED.match(span).group(0)
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _resolve_file(span: str) -> bool:
    span = span.removeprefix("./")
    roots = [
        ROOT,
        ROOT / "src",
        ROOT / "src" / "islands",
        ROOT / "bench",
        ROOT / "bench" / "islands_bench",
        ROOT / "tests",
        ROOT / "docs",
    ]
    if any((r / span).exists() for r in roots):
        return True
    # a bare file name (`codec.py`) must exist somewhere in the sources
    return "/" not in span and any(any(base.rglob(span)) for base in SOURCES)


def _resolve_ident(span: str) -> bool:
    name, _, member = span.partition(".")
    defs = _definitions()
    return name in defs and (not member or member in defs[name])


def _code_spans() -> list[tuple[str, str]]:
    out = []
    for span in _spans():
        if span in NOT_OURS:
            continue
        if _DOTTED.match(span):
            out.append(("module path", span))
        elif _FILE.match(span):
            out.append(("file", span))
        elif _IDENT.match(span):
            out.append(("identifier", span))
    return out


def test_the_doc_names_code():
    kinds = {kind for kind, _ in _code_spans()}
    assert kinds == {"module path", "file", "identifier"}, kinds


@pytest.mark.parametrize(("kind", "span"), _code_spans(), ids=lambda v: v if isinstance(v, str) else None)
def test_named_code_exists(kind, span):
    resolve = {"module path": _resolve_dotted, "file": _resolve_file, "identifier": _resolve_ident}[kind]
    assert resolve(span), f"docs/architecture.md names {kind} `{span}`, which does not exist"
