"""No capability of a strategy, a comm or a world is found by probing for an attribute (#33's contracts): each one
is a Protocol in islands.sync.base or islands.runtime.contracts, checked with isinstance. This scans src/ for
getattr/hasattr calls whose object is named as one of those components."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[3] / "src" / "islands"
# the last name of the probed expression: trainer.strategy, self.comm, world, outer, self.membership, ...
COMPONENT = re.compile(r"(^|[._])(strategy|comm|world|outer|membership|coordinator|sched)$")


def probes(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
            and COMPONENT.search(ast.unparse(node.args[0]))
        ):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_getattr_or_hasattr_on_a_component():
    hits = [
        f"{path.relative_to(SRC.parent)}:{line}: {text}"
        for path in sorted(SRC.rglob("*.py"))
        for line, text in probes(ast.parse(path.read_text(), str(path)))
    ]
    assert not hits, "capability probes (use a Protocol and isinstance instead):\n" + "\n".join(hits)


def test_the_scan_finds_a_probe():
    code = 'a = getattr(self.comm, "ledger", None)\nb = hasattr(trainer.strategy, "outer")\nc = getattr(cb, "x")\n'
    assert [line for line, _ in probes(ast.parse(code))] == [1, 2]
