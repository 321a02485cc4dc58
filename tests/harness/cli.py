"""Helpers for tests that run islands' CLI jobs and trainers: the CLI in this process (islands_cli), the tiny
byte-LM config (TINY, TINY_FLAGS), a trainer from it, resume, and exact comparison of saved states."""

import os
import signal
import threading
from pathlib import Path

import numpy as np
import torch

from harness.flags import tiny
from islands.app.build import build_trainer, resume_trainer
from islands.app.validate import validate
from islands.cli import main
from islands.config import from_mapping
from islands.loop import Trainer
from islands.runtime.world import World

TINY = dict(
    d_model=32,
    n_layers=1,
    n_heads=2,
    context=32,
    global_batch=4,
    eval_batches=2,
    threads=1,
    progress=False,
    eval_every=0,
    warmup=2,
    log_every=2,
)
TINY_FLAGS = tiny(eval_batches=2, threads=1, eval_every=0, warmup=2, log_every=2, no_progress=True)
EXACT = ("model", "optimizer", "strategy", "rng", "loader", "step")


def islands_cli(*argv: str, timeout: float = 300) -> int:
    """`islands ARGV` with this process as the CLI: the launcher (islands.runtime.launch.ranks) starts and supervises
    the rank processes exactly as from a shell, without a fresh interpreter importing torch just to launch them.
    Returns the exit code. A job still running after `timeout` s gets SIGTERM, which the launcher turns into
    stopping every rank and exit code 143 (its handler is in place only on the main thread, hence the check)."""
    rank = os.environ.pop("RANK", None)  # a torchrun variable left in the environment would make this a worker
    on_main = threading.current_thread() is threading.main_thread()
    watchdog = threading.Timer(timeout, os.kill, (os.getpid(), signal.SIGTERM))
    if on_main:
        watchdog.start()
    try:
        main(list(argv))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    finally:
        watchdog.cancel()
        if rank is not None:
            os.environ["RANK"] = rank
    return 0


def same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, np.ndarray):
        return isinstance(y, np.ndarray) and x.dtype == y.dtype and np.array_equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and list(x) == list(y) and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
    return x == y


def trainer(tmp: Path, name: str, **overrides) -> Trainer:
    cfg = validate(from_mapping({**TINY, "workers": 1, **overrides}))
    t = build_trainer(cfg, World.single(), tmp / name)
    t.job = cfg  # the test's own note of the config it was built from (run, resume_at)
    return t


def run(t: Trainer) -> dict:
    return t.fit(t.job.train.steps)


def resume_at(t: Trainer, path) -> dict:
    """Resume `t` from `path` (a run dir, checkpoint dir or step dir), with the rest of its config."""
    cfg = from_mapping({"resume": str(path)}, base=t.job)
    return resume_trainer(t, cfg)
