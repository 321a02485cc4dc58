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


def _assignments(text: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-Z_]+)=(\S+)", text, flags=re.M))


def _boxes(text: str) -> dict[str, int]:
    declared = re.search(r"^declare -A box=\(([^)]*)\)", text, flags=re.M)
    assert declared, "the script's box table is gone"
    return {k: int(v) for k, v in re.findall(r"\[([\w-]+)\]=(\d+)", declared.group(1))}


def test_one_call_runs_the_tests_the_throughput_and_a_part_of_the_sweep_within_its_budget():
    """Issue #34 item 6's call: the CUDA tests, gpu-throughput (eager and compiled) and the sweep by default, the
    boxes before the sweep leaving it at least its minimum, and the whole run, a box's kill grace included, under
    9 minutes (the device gives a command 10)."""
    text = _script()
    default = re.search(r"^DEFAULT_STEPS=\(([^)]*)\)", text, flags=re.M)
    assert default and default.group(1).split() == ["tests", "throughput", "sweep"]
    values = _assignments(text)
    budget = int(re.search(r"budget=\$\{GPU_CHECK_BUDGET_S:-(\d+)\}", text).group(1))
    setup, sweep_min = int(values["SETUP_S"]), int(values["SWEEP_MIN_S"])
    boxes = _boxes(text)
    assert boxes["sweep"] == 0  # the budget's rest
    grace = int(re.search(r"timeout -k (\d+) ", text).group(1))
    assert budget + grace <= 9 * 60
    least = budget - setup - boxes["tests"] - boxes["throughput"]
    assert least >= sweep_min >= 60, f"the boxes leave the sweep {least} s at the least"
    # gpu-throughput's eager run took 112 s on an H200 and its compiled arms add inductor's compile (40-90 s)
    assert boxes["throughput"] >= 112 + 90 + 20
    assert boxes["tests"] >= 98 + 60  # the 44 tests of 2026-12-04, plus the elastic and shared-GPU ones
    assert f"{budget} - {setup} - {boxes['tests']} - {boxes['throughput']} = {least} s" in text


def test_the_docs_plan_gives_the_scripts_boxes():
    text = _script()
    boxes = _boxes(text)
    doc = (ROOT / "docs" / "gpu.md").read_text()
    rows = dict(re.findall(r"^\| `([\w-]+)` \| [^|]+ \| ([^|]+) \|", doc, flags=re.M))
    assert set(rows) == set(boxes)
    for step, box in boxes.items():
        if step == "sweep":
            least = int(re.search(r"at least [\d -]+= (\d+) s", rows[step]).group(1))
            setup = int(_assignments(text)["SETUP_S"])
            budget = int(re.search(r"budget=\$\{GPU_CHECK_BUDGET_S:-(\d+)\}", text).group(1))
            assert least == budget - setup - boxes["tests"] - boxes["throughput"]
            assert f"skipped under {_assignments(text)['SWEEP_MIN_S']} s" in rows[step]
        else:
            assert rows[step].strip() == f"{box} s", (step, rows[step])
    assert "170 s box" not in doc


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
