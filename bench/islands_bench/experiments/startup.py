"""startup: how long a job takes to start its workers, forked from the fork server or as fresh interpreters.

islands forks the ranks of its own modules from one process that imported torch and islands once
(islands.runtime.launch.spawn); ISLANDS_SPAWN=exec starts each as a fresh interpreter, as torchrun and
subprocess-based launchers do. Both arms run the same short job through the CLI (`python -m islands train`,
a fresh launcher each time, so the fork server's own start is counted), interleaved, in one invocation:
a DDP job of N workers and an elastic DiLoCo job of N one-worker islands (job host, admission, epoch 0).
Reported: wall time of the whole job, the training time inside it (the run record's elapsed), and what is
left (start-up and shutdown), median over repetitions; the ratio exec/fork is the speed-up.

A third job is a user's script: `islands run --separate-jobs` of the frameworks experiment's Hugging Face Trainer
worker (2 islands, GPT-2 from a config, DiLoCo through the callback), with `--preload` naming what it imports
("fork": each rank a copy of a server that imported transformers' Trainer once) against without it ("exec": each
rank a fresh interpreter, the default, as torchrun starts them). Its whole wall time is reported (the script
writes no run record), and the CPU the job used (the launcher's and every process it started, read from a cpuacct
cgroup when this machine has cgroup v1 and the bench runs as root; else not measured).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from islands_bench.experiments import frameworks_worker
from islands_bench.harness import BenchContext, experiment

STEPS = 5
# what frameworks_worker imports for the Hugging Face arm: the Trainer and GPT-2 are lazy submodules of transformers
SCRIPT_PRELOAD = "transformers.trainer,transformers.models.gpt2.modeling_gpt2,islands.integrations.transformers"
CGROUP = Path("/sys/fs/cgroup/cpuacct")


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


def _script_job(mode: str, workers: int, run_dir: Path) -> list[str]:
    """`islands run --separate-jobs` of the Hugging Face worker, 2 islands, with --preload for the "fork" arm."""
    spec = {"steps": 4, "inner_steps": 2, "context": 32, "batch": 4, "lr": 3e-3, "weight_decay": 0.0}
    spec.update(max_grad_norm=1.0, val_windows=2, framework="hf", outer=True, tmp=str(run_dir / "trainer"))
    args = [sys.executable, "-m", "islands", "run", "--workers", str(workers), "--islands", "2", "--separate-jobs"]
    args += ["--run-dir", str(run_dir / "job"), *(["--preload", SCRIPT_PRELOAD] if mode == "fork" else [])]
    return [*args, frameworks_worker.__file__, json.dumps(spec), str(run_dir)]


def _cpu_cgroup(label: str) -> Path | None:
    """A fresh cpuacct cgroup to run an arm in (its CPU includes every process the arm starts, the fork server's
    children too, which no rusage of ours sees); None where there is none to make (no cgroup v1, not root)."""
    group = CGROUP / f"islands-bench-startup-{os.getpid()}-{label}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cpuacct.usage").write_text("0")
    except OSError:
        return None
    return group


def _run(ctx: BenchContext, kind: str, mode: str, workers: int, rep: int) -> dict:
    label = f"{kind}-{mode}-{rep}"
    run_dir = ctx.out_dir / "runs" / label
    script = kind == "hf-script"
    env = dict(os.environ, OMP_NUM_THREADS="1") if script else dict(os.environ, ISLANDS_SPAWN=mode)
    argv = _script_job(mode, workers, run_dir) if script else _job(kind, workers, run_dir)
    group = _cpu_cgroup(label)
    if group is not None:  # the child enters the cgroup before it execs, so everything it starts is counted
        argv = ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh", *argv]
    with ctx.arm(label):
        t = time.perf_counter()
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
        wall = time.perf_counter() - t
    cpu_s = None
    if group is not None:
        cpu_s = int((group / "cpuacct.usage").read_text()) / 1e9
        with contextlib.suppress(OSError):
            group.rmdir()
    if done.returncode != 0:
        raise RuntimeError(f"startup arm {label} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    record = None if script else json.loads((run_dir / "run.json").read_text())
    train_s = None if record is None else float(record["summary"]["wall_seconds"])
    rest_s = wall - (train_s or 0.0)
    return {
        "kind": kind,
        "mode": mode,
        "rep": rep,
        "wall_s": wall,
        "train_s": train_s,
        "rest_s": rest_s,
        "cpu_s": cpu_s,
    }


def _median(values: list) -> float | None:
    """The median, or None when a run did not measure the quantity (no run record, no cgroup)."""
    return None if None in values else statistics.median(values)


@experiment("startup", help="job start-up with workers forked from the preloaded fork server vs fresh interpreters")
def startup(ctx: BenchContext) -> dict:
    workers, reps = (2, 1) if ctx.smoke else (4, 2) if ctx.quick else (4, 5)
    # the script arm needs transformers (islands[frameworks]); without it the experiment says so and runs the rest
    script = ("hf-script",) if importlib.util.find_spec("transformers") is not None else ()
    kinds, modes = ("ddp", "elastic", *script), ("fork", "exec")
    ctx.plan(len(kinds) * len(modes) * reps)
    runs = [_run(ctx, kind, mode, workers, rep) for rep in range(reps) for kind in kinds for mode in modes]
    rows, headline = [], []
    for kind in kinds:
        med = {
            mode: {
                k: _median([r[k] for r in runs if r["kind"] == kind and r["mode"] == mode])
                for k in ("wall_s", "train_s", "rest_s", "cpu_s")
            }
            for mode in modes
        }
        for mode in modes:
            rows.append(
                {
                    "job": kind,
                    "workers": workers,
                    "spawn": mode,
                    **{k: None if v is None else round(v, 2) for k, v in med[mode].items()},
                }
            )
        fork, fresh = med["fork"], med["exec"]
        cpu = (
            f"; CPU {fork['cpu_s']:.1f} s vs {fresh['cpu_s']:.1f} s ({fresh['cpu_s'] / max(fork['cpu_s'], 1e-9):.2f}x)"
            if fork["cpu_s"] is not None and fresh["cpu_s"] is not None
            else ""
        )
        if kind == "hf-script":
            headline.append(
                f"a user's script (`islands run --separate-jobs`, HF Trainer + GPT-2, 2 islands of "
                f"{workers // 2}): whole job {fork['wall_s']:.1f} s with --preload vs {fresh['wall_s']:.1f} s fresh "
                f"interpreters ({fresh['wall_s'] / max(fork['wall_s'], 1e-9):.2f}x){cpu} (median of {reps})"
            )
            continue
        headline.append(
            f"{kind} job of {workers} workers, {STEPS} steps: start-up and shutdown {fork['rest_s']:.1f} s "
            f"forked vs {fresh['rest_s']:.1f} s fresh interpreters "
            f"({fresh['rest_s'] / max(fork['rest_s'], 1e-9):.2f}x); whole job "
            f"{fork['wall_s']:.1f} s vs {fresh['wall_s']:.1f} s (median of {reps}){cpu}"
        )
    if not script:
        headline.append("a user's script with --preload: not measured (transformers is not installed)")
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
            "same invocation",
            "the user's script: the same `islands run` without --preload (fresh interpreters), interleaved",
        ],
    }
