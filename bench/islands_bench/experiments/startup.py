"""startup: how long a job takes to start its workers, forked from the fork server or as fresh interpreters.

islands forks the ranks of its own modules from one process that imported torch and islands once
(islands.runtime.launch.spawn); ISLANDS_SPAWN=exec starts each as a fresh interpreter, as torchrun and
subprocess-based launchers do. Both arms run the same short job through the CLI (`python -m islands train`,
a fresh launcher each time, so the fork server's own start is counted), interleaved, in one invocation:
a DDP job of N workers and an elastic DiLoCo job of N one-worker islands (job host, admission, epoch 0).
Reported: wall time of the whole job, the training time inside it (the run record's elapsed), and what is
left (start-up and shutdown), median over repetitions; the ratio exec/fork is the speed-up.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from islands_bench.harness import BenchContext, experiment

STEPS = 5


def _job(kind: str, workers: int, run_dir: Path) -> list[str]:
    args = [
        sys.executable,
        "-m",
        "islands",
        "train",
        "--task",
        "digits",
        "--workers",
        str(workers),
        "--steps",
        str(STEPS),
        "--global-batch",
        str(8 * workers),
        "--eval-every",
        "0",
        "--no-probe",
        "--no-progress",
        "--warmup",
        "1",
        "--run-dir",
        str(run_dir),
    ]
    if kind == "elastic":
        args += ["--islands", str(workers), "--elastic", "--outer", "diloco:inner_steps=5"]
    return args


def _run(ctx: BenchContext, kind: str, mode: str, workers: int, rep: int) -> dict:
    label = f"{kind}-{mode}-{rep}"
    run_dir = ctx.out_dir / "runs" / label
    env = dict(os.environ, ISLANDS_SPAWN=mode)
    with ctx.arm(label):
        t = time.perf_counter()
        done = subprocess.run(_job(kind, workers, run_dir), env=env, capture_output=True, text=True, timeout=900)
        wall = time.perf_counter() - t
    if done.returncode != 0:
        raise RuntimeError(f"startup arm {label} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    record = json.loads((run_dir / "run.json").read_text())
    train_s = float(record["summary"]["wall_seconds"])
    return {"kind": kind, "mode": mode, "rep": rep, "wall_s": wall, "train_s": train_s, "rest_s": wall - train_s}


@experiment("startup", help="job start-up with workers forked from the preloaded fork server vs fresh interpreters")
def startup(ctx: BenchContext) -> dict:
    workers, reps = (2, 1) if ctx.smoke else (4, 2) if ctx.quick else (4, 5)
    kinds, modes = ("ddp", "elastic"), ("fork", "exec")
    ctx.plan(len(kinds) * len(modes) * reps)
    runs = [_run(ctx, kind, mode, workers, rep) for rep in range(reps) for kind in kinds for mode in modes]
    rows, headline = [], []
    for kind in kinds:
        med = {
            mode: {
                k: statistics.median(r[k] for r in runs if r["kind"] == kind and r["mode"] == mode)
                for k in ("wall_s", "train_s", "rest_s")
            }
            for mode in modes
        }
        for mode in modes:
            rows.append(
                {"job": kind, "workers": workers, "spawn": mode, **{k: round(v, 2) for k, v in med[mode].items()}}
            )
        headline.append(
            f"{kind} job of {workers} workers, {STEPS} steps: start-up and shutdown {med['fork']['rest_s']:.1f} s "
            f"forked vs {med['exec']['rest_s']:.1f} s fresh interpreters "
            f"({med['exec']['rest_s'] / max(med['fork']['rest_s'], 1e-9):.2f}x); whole job "
            f"{med['fork']['wall_s']:.1f} s vs {med['exec']['wall_s']:.1f} s (median of {reps})"
        )
    headline.append(
        f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at the end (shared: times are noisy)"
    )
    return {
        "rows": rows,
        "headline": headline,
        "runs": runs,
        "interconnect": ["loopback: launcher and workers as processes on this machine, gloo over 127.0.0.1"],
        "baseline": [
            "the same job with ISLANDS_SPAWN=exec (one fresh interpreter per worker), interleaved in the "
            "same invocation"
        ],
    }
