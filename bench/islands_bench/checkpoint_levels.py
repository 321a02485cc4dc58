"""Measurement cores for ckpt-levels (SOTA-057): cost of each checkpoint level, and a rank loss in a real
2-rank gloo job whose lost state comes back from the peer copy of the memory level.

`level_costs` (one process): for memory / local disk / remote directory, the save cost (synchronous,
so it is the level's whole persist) and the restore time, on a state tree that changes every save
(as training's does, so dedup cannot make a save free).

`rank_loss_job` (2 spawned gloo ranks through the CheckpointDriver): each rank trains its
own small model (different seeds: the ranks' states differ) with the memory level replicated to the
next rank, local disk and remote levels at their own intervals; at the failure step rank 1 loses its
memory and trainer state, as a replacement process would; the driver's `restore_peer` gives it back its
state from rank 0's copy. Each rank also restores from its own local and remote levels, so the run
reports the work each level would have lost and how long each restore took.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path

import torch

from islands import World
from islands.checkpoint import CheckpointSettings, CheckpointStore
from islands.checkpoint.policy import CheckpointDriver
from islands.checkpoint.store import DiskLevel, MemoryLevel
from islands.models import ByteTransformer


def perturbed(tree, step: int):
    """A copy of `tree` whose float tensors changed a little, as after an optimizer step."""
    if isinstance(tree, dict):
        return {k: perturbed(v, step) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor) and tree.is_floating_point():
        return tree + 1e-6 * step
    return tree


def level_costs(tree, root: Path, *, samples: int = 3) -> list[dict]:
    """Save cost and restore time per level (seconds, median of `samples`), on the same state tree."""
    levels = [
        MemoryLevel(every=1),
        DiskLevel(CheckpointStore(root / "local", keep_last=2), every=1, name="local"),
        DiskLevel(CheckpointStore(root / "remote", keep_last=2), every=1, name="remote"),
    ]
    rows = []
    for level in levels:
        saves, loads = [], []
        for step in range(1, samples + 1):
            t = perturbed(tree, step)
            t0 = time.perf_counter()
            level.save(t, step)
            saves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got_step, loader = level.candidates()[0]
            loader(None, None)
            loads.append(time.perf_counter() - t0)
            if got_step != step:
                raise AssertionError(f"{level.name} restored step {got_step}, saved {step}")
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        rows.append({"level": level.name, "save_s": med(saves), "restore_s": med(loads), "samples": samples})
    return rows


class _LoopTrainer:
    """A TrainingState (islands.checkpoint.policy.driver) around a real model and AdamW."""

    shard_items = -1  # no data shard: batches are drawn from a generator

    def __init__(self, rank: int, d_model: int, n_layers: int, world):
        torch.manual_seed(100 + rank)  # ranks hold different states: a copy of the wrong rank would show
        self.world = world
        self.model = ByteTransformer(d_model=d_model, n_layers=n_layers, n_heads=4, context=64)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(rank)
        self.step, self.elapsed = 0, 0.0

    def train_step(self) -> None:
        t0 = time.perf_counter()
        x = torch.randint(0, 256, (4, 64), generator=self.gen)
        loss = torch.nn.functional.cross_entropy(self.model(x)[:, :-1].reshape(-1, 256), x[:, 1:].reshape(-1))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.step += 1
        self.elapsed += time.perf_counter() - t0

    def model_state_dict(self) -> dict:
        return self.model.state_dict()

    def state_dict(self) -> dict:
        return {"step": self.step, "model": self.model.state_dict(), "optimizer": self.opt.state_dict()}

    def load_state_dict(self, tree: dict) -> None:
        self.model.load_state_dict(tree["model"])
        self.opt.load_state_dict(tree["optimizer"])
        self.step = int(tree["step"])


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _worker(rank: int, size: int, port: int, out: str, plan: dict) -> None:
    import torch.distributed as dist

    result: dict = {"rank": rank}
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60))
        settings = CheckpointSettings(
            dir=f"{out}/local",
            every=plan["local_every"],
            memory_every=plan["memory_every"],
            memory_peer=True,
            remote_dir=f"{out}/remote",
            remote_every=plan["remote_every"],
            timeout=60.0,
        )
        world = World(rank=rank, size=size, islands=1, device=torch.device("cpu"), backend="gloo")
        driver = CheckpointDriver(settings, world)
        trainer = _LoopTrainer(rank, plan["d_model"], plan["n_layers"], world)
        history = {}  # step -> state at the memory-level steps near the failure, to check restores bitwise
        for _ in range(plan["fail_at"]):
            trainer.train_step()
            driver.after_step(trainer)
            if trainer.step % plan["memory_every"] == 0 and trainer.step > plan["fail_at"] - plan["remote_every"] - 1:
                history[trainer.step] = copy.deepcopy(driver.tree(trainer))
        driver.writer.wait()
        result["iter_s"] = trainer.elapsed / trainer.step
        result["stall_s_total"] = driver.stall_s
        # the failure: rank 1 is replaced; a replacement starts with empty memory
        t0 = time.perf_counter()
        restored = driver.restore_peer(lost=(rank == 1))
        peer_s = time.perf_counter() - t0
        peer_ok = restored is not None and _same(restored.tree, history.get(restored.step))
        result["levels"] = {
            "memory-peer": {"step": restored.step if restored else None, "restore_s": peer_s, "bitwise": bool(peer_ok)}
        }
        for name in ("local", "remote"):
            level = driver._by_name[name]
            t0 = time.perf_counter()
            loaded = level.store.load()
            result["levels"][name] = {
                "step": loaded.step,
                "restore_s": time.perf_counter() - t0,
                "bitwise": _same(loaded.tree, history[loaded.step]) if loaded.step in history else None,
            }
        result["ledger_replicate_bytes"] = world.ledger.sent.get("ckpt_replicate", 0)
        result["fail_at"] = plan["fail_at"]
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - any failure goes into this rank's result file for the parent to report
        result["error"] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def rank_loss_job(plan: dict, *, tmp_parent: Path | None = None, port: int) -> list[dict]:
    """Run the 2-rank job of `plan` (memory_every, local_every, remote_every, fail_at, d_model, n_layers)."""
    import torch.multiprocessing as mp

    out = Path(tempfile.mkdtemp(prefix="ckpt-levels-", dir=tmp_parent))
    try:
        mp.start_processes(_worker, args=(2, port, str(out), plan), nprocs=2, join=True, start_method="spawn")
        results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    for r in results:
        if "error" in r:
            raise RuntimeError(f"rank {r['rank']} failed:\n{r['error']}")
    return results
