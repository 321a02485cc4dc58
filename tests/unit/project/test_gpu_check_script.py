"""scripts/gpu-check cannot break unseen between the rare sessions lent a GPU: every path and experiment it names
exists, the `cuda` marker it selects the tests by is registered, every test that needs a CUDA device carries that
marker, and the marked tests collect and pass or skip on a machine without one (its dry run, GPU_CHECK_DEVICE=cpu,
runs the whole script on the CPU: bench/tests/test_gpu_check_dry.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gpu-check"
TESTS = ROOT / "tests"


def _script() -> str:
    return SCRIPT.read_text()


def _bench_steps(text: str) -> dict[str, str]:
    """step -> the experiment its command runs, from command_of's `case` arms."""
    return dict(re.findall(r'^\s*([\w-]+)\) cmd=\("\$\{bench\[@\]\}" ([\w-]+) ', text, flags=re.M))


def test_every_repository_path_the_script_names_exists():
    # the tree's own folders: what the script runs or points a reader to (outputs such as results/ and runs/ are
    # made by the run, .whl/ is fetched by hand)
    named = set(re.findall(r"(?<![\w./-])((?:tests|src|bench|scripts|docs)(?:/[\w.-]+)*)", _script()))
    assert {"tests", "docs/gpu.md"} <= named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"scripts/gpu-check names paths that do not exist: {missing}"


def test_every_bench_step_runs_a_registered_experiment_with_a_cuda_variant_and_keeps_its_results():
    from islands_bench.harness import load_all

    text = _script()
    steps = _bench_steps(text)
    assert set(steps) == {"throughput", "sweep", "compressor", "codec-scale", "ckpt-stall"}
    registry = load_all()
    for step, name in steps.items():
        assert name in registry, f"step {step} runs {name!r}, which is not a registered experiment"
        assert "cuda" in registry[name].devices, f"step {step}: {name} has no --device cuda variant"
        assert re.search(rf"^\s*{re.escape(step)}\) collect {re.escape(name)} ;;", text, flags=re.M), (
            f"step {step}'s results ({name}) are not copied into OUT_DIR"
        )
    declared = re.search(r"^STEPS=\(([^)]*)\)", text, flags=re.M)
    assert declared and declared.group(1).split() == [
        "tests",
        "throughput",
        "sweep",
        "compressor",
        "codec-scale",
        "ckpt-stall",
    ]


def test_the_marker_the_script_selects_by_is_registered(pytestconfig):
    assert re.search(r"-m pytest .*-m cuda tests\b", _script())
    assert any(m.split(":")[0].strip() == "cuda" for m in pytestconfig.getini("markers"))


def _needs_cuda(marks: str) -> bool:
    return re.search(r"\bnot\s+(?:torch\.)?cuda\.is_available\(\)", marks) is not None


def test_every_test_that_needs_cuda_carries_the_cuda_marker():
    """A test skipped without CUDA (a skipif on torch.cuda.is_available(), on it or on its module) must be marked
    `cuda`, or the GPU run leaves it out."""
    unmarked = []
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        module_marks = " ".join(
            ast.unparse(node.value)
            for node in tree.body
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
        )
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or not node.name.startswith("test"):
                continue
            marks = " ".join(ast.unparse(d) for d in node.decorator_list) + " " + module_marks
            if _needs_cuda(marks) and "mark.cuda" not in marks:
                unmarked.append(f"{path.relative_to(ROOT)}::{node.name}")
    assert not unmarked, f"tests that need CUDA without @pytest.mark.cuda: {unmarked}"


class _Outcomes:
    """A plugin for the nested session: what it collected and how each test ended."""

    def __init__(self):
        self.collected: list = []
        self.reports: list = []

    def pytest_collection_finish(self, session):
        self.collected = list(session.items)

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.reports.append(report)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the marked tests are the GPU run itself")
def test_the_marked_tests_collect_and_pass_or_skip_without_cuda():
    here = Path(__file__).resolve()
    files = sorted(str(p) for p in TESTS.rglob("test_*.py") if "mark.cuda" in p.read_text() and p.resolve() != here)
    assert files
    seen = _Outcomes()
    args = ["-q", "-p", "no:cacheprovider", "-m", "cuda", "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml")]
    code = pytest.main([*args, *files], plugins=[seen])
    assert code == 0, f"pytest -m cuda on {files} without CUDA exited {code}"
    assert len(seen.collected) >= 30  # 39 when this was written: test_cuda.py's cases and the scattered ones
    assert all(item.get_closest_marker("cuda") for item in seen.collected)
    bad = [r.nodeid for r in seen.reports if r.failed]
    assert not bad, f"cuda-marked tests failed without CUDA: {bad}"
    skipped = [r for r in seen.reports if r.skipped]
    assert skipped and all("CUDA" in str(r.longrepr) for r in skipped)
