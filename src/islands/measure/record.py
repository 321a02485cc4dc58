"""The run record: every number with the interconnect it was measured on and the baseline it is relative to."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from islands.version import __version__

BASELINE_PER_WORKER = (
    "per worker: one process with {threads} torch thread(s) on {device}; "
    "speed-ups are relative to one such worker, not to a node"
)


def git_revision() -> str:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        rev = out.stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return (rev + ("-dirty" if dirty else "")) if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict:
    return {
        "islands": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_revision": git_revision(),
        "cpu_count": os.cpu_count(),
    }


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def plot_loss(record: dict, path: Path) -> None:
    """Validation loss against steps and against MB communicated per worker; nothing for a run without evaluations
    (matplotlib's import alone is ~0.7 CPU-s, which such a run, every elastic test job among them, need not pay)."""
    val = record["series"]["val"]
    if not val:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [v["step"] for v in val]
    loss = [v["val_loss"] for v in val]
    mb = [v["mb_sent"] for v in val]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(steps, loss, marker="o")
    a.set_xlabel("step")
    a.set_ylabel("validation loss")
    b.plot(mb, loss, marker="o", color="tab:orange")
    b.set_xlabel("MB sent per worker (payload)")
    b.set_ylabel("validation loss")
    s = record["summary"]
    fig.suptitle(
        f"{s['strategy']}, {s['workers']} workers / {s['islands']} island(s) — {record['interconnect_line']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# Set by islands' launchers in their workers' environment: the launcher draws loss.png once the job has ended, so
# rank 0 skips matplotlib (~1.2 CPU-s: its import and the figure) and exits sooner. A worker started any other way
# (a user's script, `islands join`) draws its own.
LAUNCHER_PLOTS_ENV = "ISLANDS_LAUNCHER_PLOTS"


def worker_plots() -> bool:
    """Whether this worker process draws loss.png itself: not when an islands launcher said it will."""
    return os.environ.get(LAUNCHER_PLOTS_ENV) != "1"


def finish_record(run_dir: Path, record: dict, plot: bool = True) -> Path:
    """Write run.json (atomically) and, with `plot`, loss.png."""
    run_dir.mkdir(parents=True, exist_ok=True)
    record["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_json_atomic(run_dir / "run.json", record)
    if plot:
        plot_loss(record, run_dir / "loss.png")
    return run_dir / "run.json"


def plot_finished_run(run_dir: Path) -> None:
    """A launcher's part, once its job has ended: loss.png from run.json, when a worker wrote one."""
    path = run_dir / "run.json"
    if path.is_file():
        plot_loss(json.loads(path.read_text()), run_dir / "loss.png")
