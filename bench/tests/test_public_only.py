"""The bench drives islands through its public API only (issue 17): an ast walk over islands_bench.

Allowed: `import islands`; `from islands import NAME`; `from islands.SUB import NAME` where NAME is in
islands.SUB's `__all__` (islands.memory, islands.outer, ...), and the same from a subpackage's `__init__`
at any depth (islands.parallel.pipeline); anything from `islands.config` and `islands.app.*` (the job API:
config -> validate -> launch) and `islands.integrations.*` (one module per framework). A module below the top
level (`islands.sync.sharded`, `islands.runtime.launch.ranks`, ...) is internal and may change without notice.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import islands_bench

BENCH = Path(islands_bench.__file__).parent
OPEN_MODULES = ("islands.config",)  # every name in it is the config API
# the job API, module by module; and each framework integration, whose module is its public face (the package does
# not re-export them, so that importing islands never imports transformers, lightning or accelerate)
OPEN_PACKAGES = ("islands.app", "islands.integrations")


def _public_names(module: str) -> set[str] | None:
    """islands.SUB's `__all__` (empty when it declares none); None when there is no such module."""
    try:
        names = getattr(importlib.import_module(module), "__all__", None)
    except ModuleNotFoundError:
        return None
    return set(names) if names is not None else set()


def _is_package(module: str) -> bool:
    return hasattr(importlib.import_module(module), "__path__")


def violations_in(source: str, where: str) -> list[str]:
    """Each import of islands in `source` that is not in an allowed form, as 'where:line: reason'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name
                if name == "islands" or not name.startswith("islands."):
                    continue
                if name in OPEN_MODULES or name.startswith(tuple(p + "." for p in OPEN_PACKAGES)):
                    continue
                if name.count(".") == 1 and alias.asname is None:
                    continue  # `import islands.memory` reaches only what `islands.memory` exposes
                found.append(f"{where}:{node.lineno}: import {name} (use `from islands.SUB import NAME`)")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mod = node.module
            if mod == "islands" or not mod.startswith("islands."):
                continue
            if mod in OPEN_MODULES or mod.startswith(tuple(p + "." for p in OPEN_PACKAGES)):
                continue
            public = _public_names(mod)
            if public is None:
                found.append(f"{where}:{node.lineno}: there is no module {mod}")
                continue
            if mod.count(".") > 1 and not _is_package(mod):
                found.append(f"{where}:{node.lineno}: from {mod} import ... reaches inside {mod.rsplit('.', 1)[0]}")
                continue
            for alias in node.names:
                if alias.name not in public:
                    found.append(f"{where}:{node.lineno}: {alias.name} is not in {mod}.__all__")
    return found


def test_the_bench_imports_islands_public_names_only():
    found = []
    for path in sorted(BENCH.rglob("*.py")):
        found += violations_in(path.read_text(), str(path.relative_to(BENCH.parent)))
    assert not found, "the bench reaches islands internals:\n" + "\n".join(found)


def test_the_walk_catches_deep_and_unexported_imports():
    bad = (
        "from islands.sync.sharded import plan_units\n"
        "import islands.runtime.launch.ranks\n"
        "from islands.memory import not_a_public_name\n"
        "from islands.parallel.pipeline.cuts import param_bytes\n"
        "from islands.no_such_module import x\n"
    )
    found = violations_in(bad, "x.py")
    assert len(found) == 5, found
    good = (
        "import islands\nfrom islands import Trainer\nfrom islands.memory import plan_micro_batch\n"
        "from islands.config import from_mapping\nfrom islands.app.launch import launch\n"
        "from islands.parallel.pipeline import param_bytes\n"
    )
    assert violations_in(good, "y.py") == []
