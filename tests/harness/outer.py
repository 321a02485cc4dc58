"""Spawn a small gloo world for the outer-strategy tests, with timeouts so nothing can hang.

`run_world(fn, size, islands)` starts `size` processes; each joins through env:// on a free loopback
port, builds the World (30 s collective timeout), calls fn(world) and sends back its result
(plain Python / numpy only: torch tensors in a queue are shared through a sender about to exit).
`tiny_model()` and `batch(rank, step)` are the model and data the outer tests train on.
"""

from __future__ import annotations

import os
import queue as _queue
import socket
import time

import torch

from harness.procs import mp_context


def tiny_model():
    from islands.models import ByteTransformer

    torch.manual_seed(0)
    return ByteTransformer(d_model=16, n_layers=1, n_heads=2, context=8)


def batch(rank: int, step: int) -> torch.Tensor:
    """Rank `rank`'s byte windows for local step `step`, the same in every process."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, 256, (4, 9), generator=g)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, size, islands, env, fn, out, init=None):
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size))
    import torch

    torch.set_num_threads(1)
    from islands.runtime.world import close_world, init_world

    world = init_world(islands=islands, timeout_s=30, **(init or {}))
    try:
        out.put((rank, "ok", fn(world)))
    except BaseException as e:  # noqa: BLE001 - report, so the parent fails with the cause instead of a timeout
        import traceback

        out.put((rank, "error", f"{e!r}\n{traceback.format_exc()}"))
    finally:
        close_world(world)


def run_world(fn, size: int, islands: int, timeout: float = 150.0, init: dict | None = None) -> list:
    """fn(world) on each of `size` ranks; `init`: more keyword arguments for init_world (e.g. cross_backend)."""
    ctx = mp_context()
    out = ctx.Queue()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    procs = [ctx.Process(target=_child, args=(r, size, islands, env, fn, out, init)) for r in range(size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"outer test world: only ranks {sorted(results)} reported within {timeout} s")
            try:
                rank, status, value = out.get(timeout=1.0)
            except _queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a rank exited with {dead} before reporting") from None
                continue
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed: {value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(size)]


def assert_train_refuses(outer: str, words: list[str], tmp_path, capsys) -> None:
    """`islands train --outer OUTER` exits 2 before any worker starts, its message holding every one of `words`."""
    import pytest

    from islands.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--workers", "2", "--islands", "2", "--outer", outer, "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert e.value.code == 2
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "r").exists()
