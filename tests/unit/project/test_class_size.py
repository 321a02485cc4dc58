"""No class in src/ holds more than 25 methods or 25 attributes (issue #33's goal: a class does one job, and a
reader holds it in their head). Counted from the source: methods defined in the class body; attributes are the
names it annotates or assigns in its body plus every `self.NAME = ...` in its methods."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[3] / "src" / "islands"
LIMIT = 25


def _sizes(cls: ast.ClassDef) -> tuple[int, int]:
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    attrs: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            attrs.add(node.target.id)
        elif isinstance(node, ast.Assign):
            attrs.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for method in methods:
        for node in ast.walk(method):
            if not isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    attrs.add(t.attr)
    return len(methods), len(attrs)


def classes():
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                yield f"{path.relative_to(SRC.parent)}:{node.lineno} {node.name}", node


def test_no_class_over_the_limit():
    over = []
    for where, cls in classes():
        methods, attrs = _sizes(cls)
        if methods > LIMIT or attrs > LIMIT:
            over.append(f"{where}: {methods} methods, {attrs} attributes")
    assert not over, "split these along a concept (limit 25 each):\n" + "\n".join(over)


def test_the_count_sees_methods_and_self_attributes():
    body = "\n".join(f"    def m{i}(self):\n        self.a{i} = {i}" for i in range(3))
    cls = ast.parse(f"class C:\n    x: int = 0\n    y = 1\n{body}\n").body[0]
    assert isinstance(cls, ast.ClassDef)
    assert _sizes(cls) == (3, 5)
