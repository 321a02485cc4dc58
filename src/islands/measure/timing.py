"""Best-of-N timing of a local computation (no collectives: see bench.spawn.time_interleaved for those)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def best_seconds(
    fn: Callable[[], object], repeats: int, *, warm: bool = True, device: torch.device | str | None = None
) -> float:
    """Least wall seconds over `repeats` calls of fn, after one untimed warm-up call (allocator and
    first-call costs) unless warm=False. The minimum is the sample least disturbed by other processes
    on shared cores. With a CUDA `device` each timing ends only when the device's queue has drained."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    cuda = device is not None and torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if warm:
        fn()
        sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best
