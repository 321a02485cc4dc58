"""The examples/ programs run as users run them: under `islands run`, under torchrun, and through `islands train`.

Each example exits non-zero when its model did not learn (global accuracy or loss checked inside), so
these tests fail on a wrong result as well as on a crash. `islands run` and `islands train` are this process
(test_checkpoint_resume.islands_cli): their launcher starts the example's ranks as separate processes, as from a
shell, without one more interpreter importing torch just to launch them. The module-path test keeps a real
`python -m islands` process: it proves the CLI finds a module in its working directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import islands_cli as cli

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"
pytestmark = pytest.mark.slow


def run(argv: list[str], cwd: Path, timeout: float = 600, **env) -> subprocess.CompletedProcess:
    out = subprocess.run(
        argv,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )
    logs = "".join(p.read_text() for p in cwd.glob("runs/*/logs/*.log"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:] + logs[-3000:]
    return out


def run_here(args: list[str], cwd: Path, monkeypatch, capfd, **env) -> str:
    """`islands ARGS` from this process, in `cwd` and with `env` added (the ranks inherit both); rank 0's stdout."""
    monkeypatch.chdir(cwd)
    for key, value in {"OMP_NUM_THREADS": "1", **env}.items():
        monkeypatch.setenv(key, value)
    capfd.readouterr()
    code = cli(*args, timeout=600)
    out = capfd.readouterr()
    logs = "".join(p.read_text() for p in cwd.glob("runs/*/logs/*.log"))
    assert code == 0, out.out[-2000:] + out.err[-3000:] + logs[-3000:]
    return out.out


def islands_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "islands", *args]


def torchrun(n: int, script: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), str(script)]


def test_own_loop_under_islands_run_then_resumed_under_torchrun(tmp_path, monkeypatch, capfd):
    # 2 workers (the example's 2 islands of one) and few steps (one DiLoCo round of 50, a checkpoint at 60): every
    # rank of a user's script is a fresh interpreter importing torch, islands and sklearn (~4 s of CPU each)
    first = run_here(
        ["run", "--workers", "2", str(EXAMPLES / "own_loop.py")],
        tmp_path,
        monkeypatch,
        capfd,
        STEPS="70",
        CKPT_EVERY="60",
    )
    assert "2 island(s), strategy ddp+diloco" in first
    assert "bn1.num_batches_tracked 70" in first  # the global model carries the BatchNorm counters
    # the same program under torchrun restores step 60 (its checkpoint) and continues to 80
    second = run(torchrun(2, EXAMPLES / "own_loop.py"), tmp_path, STEPS="80", CKPT_EVERY="60")
    assert "bn1.num_batches_tracked 80" in second.stdout
    steps = sorted(p.name for p in (tmp_path / "runs" / "own-loop").glob("step-*"))
    assert steps == ["step-000060"]


def test_zero_touch_under_islands_run(tmp_path, monkeypatch, capfd):
    out = run_here(
        ["run", "--workers", "2", "--islands", "2", str(EXAMPLES / "zero_touch.py")], tmp_path, monkeypatch, capfd
    )
    assert "2 island(s), 3 DiLoCo rounds" in out


def test_trainer_on_a_transformers_gpt2(tmp_path, monkeypatch, capfd):
    pytest.importorskip("transformers")
    out = run_here(
        ["run", "--workers", "2", "--islands", "2", str(EXAMPLES / "trainer_gpt2.py")],
        tmp_path,
        monkeypatch,
        capfd,
        STEPS="40",
    )
    assert "strategy ddp+streaming-diloco" in out


def test_cli_task_through_islands_train(tmp_path, monkeypatch, capfd):
    run_here(
        [
            "train",
            "--task",
            f"{EXAMPLES / 'cli_task.py'}:make_task",
            "--workers",
            "2",
            "--islands",
            "2",
            "--outer",
            "diloco:inner_steps=10",
            "--steps",
            "30",
            "--eval-every",
            "10",
            "--ckpt-every",
            "15",
            "--run-dir",
            "run",
            "--no-progress",
        ],
        tmp_path,
        monkeypatch,
        capfd,
    )
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["summary"]["task"] == "digits-cnn"
    assert record["summary"]["strategy"] == "ddp+diloco"
    assert record["summary"]["final_val_accuracy"] > 0.5
    assert record["checkpoint"]["saves"]["local"] == 2  # steps 15 and 30


def test_cli_task_by_module_path_with_options_from_toml(tmp_path):
    (tmp_path / "mytasks").mkdir()
    (tmp_path / "mytasks" / "__init__.py").write_text((EXAMPLES / "cli_task.py").read_text())
    (tmp_path / "job.toml").write_text(
        '[task]\nname = "mytasks:make_task"\n[task.options]\nwidth = 8\n'
        "[train]\nsteps = 5\neval_every = 0\n[world]\nworkers = 1\n"
    )
    run(islands_cli("train", "--config", "job.toml", "--run-dir", "run", "--no-progress"), tmp_path)
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["summary"]["steps"] == 5
    assert record["config"]["task"]["options"] == {"width": 8}
