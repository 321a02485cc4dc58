"""transformers, lightning and accelerate are extras (pyproject `frameworks`): importing islands, its CLI or the
integrations' shared part must not import any of them; only the callbacks' own modules do."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FRAMEWORKS = ("transformers", "lightning", "pytorch_lightning", "accelerate")


def imported_after(statement: str) -> list[str]:
    code = f"import sys, json; {statement}; print(json.dumps(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "statement",
    ["import islands", "import islands.cli", "import islands.integrations", "import islands.runtime.cross"],
)
def test_the_core_imports_no_framework(statement):
    assert imported_after(statement) == []


def test_each_callback_module_imports_its_framework():
    assert "transformers" in imported_after("import islands.integrations.transformers")
    assert "lightning" in imported_after("import islands.integrations.lightning")
