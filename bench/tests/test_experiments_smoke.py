"""Every registered experiment still runs: `islands bench NAME --smoke` from a fresh directory exits 0 and
writes its result.

One case per name in the registry, so a newly registered experiment is covered without editing this file.
Each runs as its own command (a fresh process, a temporary working directory and --out), as a user would
run it. An experiment that needs something a machine may lack is skipped only when that thing is missing,
with a reason naming it (NEEDS). Run the lane: python -m pytest -m experiments -n 2
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from islands_bench import harness

NAMES = sorted(harness.load_all())
# One smoke run's limit: a hang, not a slow case, should trip it (the slowest take about a minute on a 2-core
# machine); ISLANDS_SMOKE_TIMEOUT_S raises it on a machine loaded by other work.
TIMEOUT_S = float(os.environ.get("ISLANDS_SMOKE_TIMEOUT_S", "300"))


def _missing_etcd() -> str | None:
    return None if shutil.which("etcd") else "the etcd binary (apt-get install etcd-server)"


def _missing_torchft() -> str | None:
    try:
        import torchft  # noqa: F401
    except ImportError:
        return "torchft (pip install torchft)"
    return None


def _missing_frameworks() -> str | None:
    try:
        import lightning  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return "transformers and lightning (pip install islands[frameworks])"
    return None


def _missing_root() -> str | None:
    return None if os.geteuid() == 0 else "root, for the testbed's network namespaces"


# Experiments that run on a rate-limited testbed (network namespaces and tc) even in the smoke tier
TESTBED = (
    "compression-time-to-target",
    "compression-vs-bandwidth",
    "fsdp-prefetch",
    "gossip",
    "matmul-overlap",
    "overlap-tau",
    "pipeline",
    "powersgd-vs-torch-hook",
    "recovery",
    "ring-attention",
    "sequence-parallel",
    "sharding-crossover",
    "utilisation",
)

# What an experiment needs beyond the CPU and the installed islands, and how to tell that it is missing
NEEDS = {
    **{name: (_missing_root,) for name in TESTBED},
    "chaos": (_missing_etcd, _missing_root),  # a 3-member etcd cluster on a testbed's hub
    "etcd-failover": (_missing_etcd,),
    "frameworks": (_missing_frameworks,),
    "chaos-torchft": (_missing_torchft, _missing_root),
}


def _bench(name: str, out: Path, cwd: Path) -> tuple[int, str, str]:
    """`islands bench NAME --smoke --out OUT` in cwd, with this checkout's islands and bench whichever the
    interpreter has installed. Past TIMEOUT_S its whole process group gets SIGTERM (the bench then stops its
    jobs and testbeds), then SIGKILL: no worker outlives the test."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root / "bench"), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-m", "islands", "bench", name, "--smoke", "--out", str(out)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stdout = stderr = ""
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                stdout, stderr = proc.communicate(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # what it printed before the limit: a slow arm or a failed one (CI has nothing else to show)
        pytest.fail(f"{name} --smoke ran past {TIMEOUT_S} s\n{stdout[-3000:]}\n{stderr[-5000:]}")
    return proc.returncode, stdout, stderr


@pytest.mark.experiments
@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_experiment_runs_in_its_smoke_tier(name, tmp_path):
    missing = [why for check in NEEDS.get(name, ()) if (why := check()) is not None]
    if missing:
        pytest.skip(f"{name} needs {', '.join(missing)}")
    out = tmp_path / "out"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    code, stdout, stderr = _bench(name, out, cwd)
    assert code == 0, f"exit {code}\n{stdout[-3000:]}\n{stderr[-5000:]}"
    result = json.loads((out / name / "smoke" / "result.json").read_text())
    assert result["experiment"] == name and result["smoke"] is True
    assert (out / name / "smoke" / "summary.md").is_file()
    assert not any(cwd.iterdir()), f"wrote into its working directory: {sorted(os.listdir(cwd))}"


def test_every_registered_experiment_has_a_smoke_case_and_every_need_names_one():
    marks = {m.name: m for m in test_experiment_runs_in_its_smoke_tier.pytestmark}
    assert sorted(marks["parametrize"].args[1]) == sorted(harness.load_all())
    assert {"experiments", "slow"} <= set(marks)  # `pytest -m experiments` selects the lane
    assert set(NEEDS) <= set(NAMES), f"NEEDS names unregistered experiments: {set(NEEDS) - set(NAMES)}"


def test_smoke_tier_cuts_every_job_to_a_few_steps(tmp_path):
    ctx = harness.BenchContext(name="t", quick=True, smoke=True, out_dir=tmp_path)
    cfg = ctx.config(task="digits", steps=200, warmup=20, eval_every=50, log_every=10, workers=1)
    t = cfg.train
    assert (t.steps, t.warmup, t.eval_every, t.log_every) == (
        harness.SMOKE_STEPS,
        harness.SMOKE_STEPS // 2,
        harness.SMOKE_STEPS,
        harness.SMOKE_STEPS,
    )
    assert ctx.config(task="digits", steps=3, eval_every=0, workers=1).train.steps == 3  # never lengthened
    quick = harness.BenchContext(name="t", quick=True, out_dir=tmp_path)
    assert quick.config(task="digits", steps=200, workers=1).train.steps == 200
