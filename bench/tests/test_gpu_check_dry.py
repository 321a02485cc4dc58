"""scripts/gpu-check's dry run (GPU_CHECK_DEVICE=cpu) end to end on the CPU: the steps run in order, every bench's
results and a summary land in OUT_DIR, and a step whose box runs out is recorded and fails the run. The steps left
out here (throughput, and ckpt-stall past its start) keep this under a minute; their benches' smoke tiers have
their own tests (bench/tests, -m experiments), and the full dry run is a manual check (docs/gpu.md). The end-to-end run
is in the experiments lane (`make test-experiments`: it runs benches' smoke tiers and collects the whole suite once,
~30 s of CPU that `make test`'s 12 minutes cannot spare); the two short checks are integration tests."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check(tmp_path: Path, out: str, **env: str) -> tuple[int, dict[str, dict], str]:
    run_env = {k: v for k, v in os.environ.items() if k != "OUT" and not k.startswith("GPU_CHECK_")}
    run_env.update(GPU_CHECK_DEVICE="cpu", GPU_CHECK_WORK=str(tmp_path / "work"), PYTHON=sys.executable, **env)
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu-check"), str(tmp_path / out)],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    with open(tmp_path / out / "summary.tsv") as f:
        rows = {r["step"]: r for r in csv.DictReader(f, delimiter="\t")}
    return proc.returncode, rows, proc.stdout + proc.stderr


@pytest.mark.experiments  # ~30 s on 2 shared cores: the tests step collects the whole suite once
@pytest.mark.slow
def test_the_dry_run_writes_every_steps_results_and_a_summary(tmp_path):
    code, rows, log = _gpu_check(tmp_path, "out", GPU_CHECK_STEPS="tests,sweep,compressor")
    assert code == 0, log[-3000:]
    assert list(rows) == ["tests", "sweep", "compressor", "total"]
    assert all(rows[s]["status"] == "0" for s in ("tests", "sweep", "compressor")), rows
    assert rows["total"]["status"] == "0" and rows["total"]["box_s"] == "520"
    # the sweep's box is the budget's rest, less the compressor's 30 s after it
    assert 400 < int(rows["sweep"]["box_s"]) < 490
    out = tmp_path / "out"
    assert "device cpu" in (out / "machine.txt").read_text()
    suite = ET.parse(out / "tests.xml").getroot().find("testsuite")
    assert suite is not None and int(suite.get("tests")) >= 30 and int(suite.get("failures")) == 0
    assert int(suite.get("errors")) == 0 and int(suite.get("skipped")) >= 25  # test_cuda.py's cases skip on the CPU
    for name in ("scale-sweep", "compressor-throughput"):
        assert (out / "bench" / name / "smoke" / "result.json").is_file(), name
    assert len(list((out / "bench" / "scale-sweep" / "smoke" / "runs").glob("*.json"))) == 3  # the arms, one each
    for step in ("tests", "sweep", "compressor"):
        assert (out / f"{step}.log").stat().st_size > 0


@pytest.mark.integration  # runs the script
def test_a_step_whose_box_runs_out_is_recorded_and_fails_the_run(tmp_path):
    code, rows, log = _gpu_check(tmp_path, "cut", GPU_CHECK_STEPS="ckpt-stall", GPU_CHECK_BOXES="ckpt-stall=1")
    assert code == 1, log[-3000:]
    assert rows["ckpt-stall"]["status"] == "124" and rows["ckpt-stall"]["box_s"] == "1"
    assert rows["total"]["status"] == "1"
    assert "its box of 1 s ran out" in log


@pytest.mark.integration
def test_an_unknown_step_is_refused_before_anything_runs(tmp_path):
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu-check"), str(tmp_path / "out")],
        env={
            **os.environ,
            "GPU_CHECK_DEVICE": "cpu",
            "GPU_CHECK_STEPS": "tests,benches",
            "GPU_CHECK_WORK": str(tmp_path),
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "unknown step 'benches'" in proc.stderr
    assert not (tmp_path / "out" / "summary.tsv").exists()
