"""Crash harness (ckpt-crash core): a child process saves in a loop; the parent kills it with SIGKILL at
random moments and checks that the store still loads an intact checkpoint and cleans the partial one.

Run as a child:  python -m islands_bench.checkpoint_crash ROOT [TENSOR_ELEMS]
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from islands.checkpoint import CheckpointStore, NoCheckpoint


def state_for(step: int, elems: int) -> dict:
    """Deterministic state for a step, so the parent can check exactly what it loaded."""
    g = torch.Generator().manual_seed(step)
    return {
        "step": step,
        "model": {"w": torch.randn(elems, generator=g), "frozen": torch.ones(64)},
        "loader": {"cursor": step * 3},
    }


def child_main(root: str, elems: int) -> None:
    store = CheckpointStore(root, keep_last=2)
    try:
        step = store.load().step + 1
    except NoCheckpoint:
        step = 0
    while True:
        store.save(state_for(step, elems), step)
        print(step, flush=True)
        step += 1


@dataclass
class CrashReport:
    trials: int = 0
    loadable: int = 0
    silent_corruptions: int = 0  # loaded but content differs from what that step saved
    no_checkpoint_yet: int = 0  # killed before the very first save finished (nothing to lose)
    leftovers_cleaned: int = 0
    problems: list[str] = field(default_factory=list)


def run_crash_trials(
    root: str | os.PathLike,
    trials: int,
    rng: random.Random,
    *,
    elems: int = 20_000,
    max_delay_s: float = 0.5,
    timeout_s: float = 30.0,
) -> CrashReport:
    report = CrashReport()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
    )
    for _ in range(trials):
        proc = subprocess.Popen(
            [sys.executable, "-m", "islands_bench.checkpoint_crash", str(root), str(elems)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        try:
            # Start the clock once the child is saving (torch import takes ~1 s), then kill at random.
            ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
            if ready:
                proc.stdout.readline()
            time.sleep(rng.uniform(0.0, max_delay_s))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=timeout_s)
            proc.stdout.close()
        report.trials += 1
        store = CheckpointStore(root, keep_last=2)
        report.leftovers_cleaned += len(store.cleaned)
        try:
            loaded = store.load()
        except NoCheckpoint as exc:
            if store.steps():
                report.problems.append(str(exc))
            else:
                report.no_checkpoint_yet += 1
            continue
        report.loadable += 1
        if loaded.skipped:  # a committed checkpoint that does not load is a failure, even with a fallback
            report.problems.extend(f"{d}: {why}" for d, why in loaded.skipped)
        expect = state_for(loaded.step, elems)
        if not (
            torch.equal(loaded.tree["model"]["w"], expect["model"]["w"]) and loaded.tree["loader"] == expect["loader"]
        ):
            report.silent_corruptions += 1
    return report


if __name__ == "__main__":
    child_main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20_000)
