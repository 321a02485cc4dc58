"""islands.checkpoint.Checkpointer around a user's own loop (issue 17: "A checkpoint restored through
Checkpointer continues bitwise (RNG included)"): N steps, save, a fresh process-like start (new model,
optimizer, Checkpointer, generators moved on) restores and trains N more; the result equals 2N steps
straight, bit for bit, in parameters, buffers, optimizer and strategy state."""

from __future__ import annotations

import functools
import random
import time

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.outer import run_world
from islands.checkpoint import (
    AutoInterval,
    Checkpointer,
    CheckpointMismatch,
    CheckpointSettings,
    CheckpointStore,
    check_resume,
    fingerprint_of,
    resume,
)
from islands.checkpoint.policy import TrainingState, parse_policy
from islands.checkpoint.policy.checkpointer import LoopState
from islands.checkpoint.policy.settings import format_policy
from islands.data.loader import ShardSampler
from islands.runtime.world import World
from islands.sync.outer import DiLoCo
from islands.sync.outer.outer_opt import OuterSGD
from islands.sync.stack import Stack

N = 4  # steps before the checkpoint; DiLoCo's rounds of 3 put it mid-round
DATA = torch.Generator().manual_seed(99)
X_ALL, Y_ALL = torch.randn(64, 8, generator=DATA), torch.randint(0, 3, (64,), generator=DATA)


def net(width: int = 16) -> nn.Module:
    """BatchNorm (buffers) and dropout (draws from torch's generator every step)."""
    return nn.Sequential(nn.Linear(8, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.3), nn.Linear(width, 3))


def fresh(seed: int, width: int = 16, device: str = "cpu"):
    torch.manual_seed(seed)
    model = net(width).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def train(model, opt, start: int, stop: int, sampler, ckpt=None, strategy=None, sched=None) -> None:
    for step in range(start, stop):
        idx = torch.from_numpy(sampler.take(8))
        # python's and numpy's generators feed the step too, so their states must come back as well
        x = X_ALL[idx] + 0.01 * random.random() + 0.01 * float(np.random.rand())
        device = next(model.parameters()).device
        loss = F.cross_entropy(model(x.to(device)), Y_ALL[idx].to(device))
        loss.backward()
        if strategy is not None:
            strategy.after_backward(model, step)
        opt.step()
        opt.zero_grad()
        if strategy is not None:
            strategy.after_step(model, opt, step)
        if sched is not None:
            sched.step()
        if ckpt is not None:
            ckpt.maybe_save(
                step + 1,
                model=model,
                optimizer=opt,
                strategy=strategy,
                data=sampler,
                extra={"sched": sched} if sched is not None else None,
            )


def differences(a, b, path: str = "") -> list[str]:
    """Paths where two state trees differ (tensors bit for bit, dtype included)."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return [path]
        return [d for k in a for d in differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [path]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}/{i}")]
    return [] if a == b else [path]


def _single_run(
    tmp_path, reseed_after_restore: int | None = None, device: str = "cpu", move_cuda_after_restore: bool = False
):
    """2N steps straight, and N + save + fresh restore + N; returns both final states."""
    seed_all(0)
    model, opt = fresh(0, device=device)
    sampler = ShardSampler(64, seed=1, shard=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    train(model, opt, 0, 2 * N, sampler, sched=sched)
    straight = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "data": sampler.state_dict(),
        "sched": sched.state_dict(),
    }

    seed_all(0)
    model, opt = fresh(0, device=device)
    sampler = ShardSampler(64, seed=1, shard=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    with Checkpointer(tmp_path, every=N) as ckpt:
        train(model, opt, 0, N, sampler, ckpt, sched=sched)

    seed_all(7)  # a new process: other initial weights, generators elsewhere
    model, opt = fresh(7, device=device)
    sampler = ShardSampler(64, seed=1, shard=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    random.random(), np.random.rand()
    with Checkpointer(tmp_path, every=N) as ckpt:
        start = ckpt.restore(model=model, optimizer=opt, data=sampler, extra={"sched": sched})
        assert start == N and ckpt.restored["level"] == "local"
        if reseed_after_restore is not None:
            torch.manual_seed(reseed_after_restore)
        if move_cuda_after_restore:
            torch.cuda.manual_seed(123)
        train(model, opt, start, 2 * N, sampler, ckpt, sched=sched)
    resumed = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "data": sampler.state_dict(),
        "sched": sched.state_dict(),
    }
    return straight, resumed


def test_restore_continues_bitwise_with_dropout_batchnorm_and_every_generator(tmp_path):
    straight, resumed = _single_run(tmp_path / "a")
    assert differences(straight, resumed) == []
    assert straight["model"]["1.num_batches_tracked"] == 2 * N  # the BatchNorm buffers ran all 2N steps
    # the same run with torch's generator moved after the restore differs: dropout's masks depend on it,
    # so the equality above needs the saved RNG state
    _, moved = _single_run(tmp_path / "b", reseed_after_restore=123)
    assert any(d.startswith("/model/") for d in differences(straight, moved))


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (dropout drawing from the CUDA generator)"
)
def test_restore_on_cuda_continues_bitwise_with_the_cuda_generator(tmp_path):
    straight, resumed = _single_run(tmp_path / "a", device="cuda")
    assert differences(straight, resumed) == []
    assert "cuda" in CheckpointStore(tmp_path / "a", clean=False).load().tree["rng"]
    # only the CUDA generator moved after the restore: dropout on the GPU draws other masks
    _, moved = _single_run(tmp_path / "b", move_cuda_after_restore=True, device="cuda")
    assert any(d.startswith("/model/") for d in differences(straight, moved))


# ---- two gloo ranks, DiLoCo across two islands -------------------------------------------------------


def _diloco_run(root: str, world) -> dict:
    def build(seed: int):
        model, opt = fresh(seed)
        # LIT-212's outer step: its momentum buffer is the outer state this test restores
        strategy = Stack(outer=DiLoCo(3, outer_optimizer=OuterSGD(0.7, 0.9, nesterov=True)))
        return strategy.wrap(model, opt, world), opt, strategy

    def final(model, opt, strategy, sampler) -> dict:
        return {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "strategy": strategy.state_dict(),
            "global": strategy.eval_model(model).state_dict(),
            "data": sampler.state_dict(),
        }

    rank = world.rank
    seed_all(10 + rank)
    model, opt, strategy = build(0)  # every island starts from the same weights
    sampler = ShardSampler(32, seed=1, shard=rank)
    train(model, opt, 0, 2 * N, sampler, strategy=strategy)
    straight = final(model, opt, strategy, sampler)

    seed_all(10 + rank)
    model, opt, strategy = build(0)
    sampler = ShardSampler(32, seed=1, shard=rank)
    with Checkpointer(root, world, every=N) as ckpt:
        train(model, opt, 0, N, sampler, ckpt, strategy=strategy)

    seed_all(50 + rank)
    model, opt, strategy = build(5)
    sampler = ShardSampler(32, seed=1, shard=rank)
    with Checkpointer(root, world, every=N) as ckpt:
        start = ckpt.restore(model=model, optimizer=opt, strategy=strategy, data=sampler)
        train(model, opt, start, 2 * N, sampler, ckpt, strategy=strategy)
        saves = ckpt.record()["saves"]
    resumed = final(model, opt, strategy, sampler)
    momentum = straight["strategy"]["outer"]["outer_opt"]["momentum_buffer"]
    return {
        "start": start,
        "diffs": differences(straight, resumed),
        "saves": saves,
        "momentum": momentum is not None and bool(momentum.abs().sum() > 0),
        "islands_differ": bool(differences(straight["model"], straight["global"])),
    }


@pytest.mark.slow  # two spawned gloo ranks: ~15 s on 2 shared cores
def test_two_ranks_with_diloco_restore_bitwise_strategy_state_included(tmp_path):
    results = run_world(functools.partial(_diloco_run, str(tmp_path / "ckpt")), size=2, islands=2)
    for rank, out in enumerate(results):
        assert out["start"] == N, out
        assert out["diffs"] == [], f"rank {rank}: {out['diffs']}"
        assert out["saves"] == {"local": 1}  # step 8 (step 4 was restored, not saved again)
        assert out["momentum"]  # the outer optimizer had state worth restoring
        assert out["islands_differ"]  # mid-round: the live model is not the global one
    store = CheckpointStore(tmp_path / "ckpt", clean=False)
    assert store.steps() == [N, 2 * N] and store.verify(N) == [] and store.verify(2 * N) == []


# ---- refusals, durability, nothing to restore ----------------------------------------------------------


def test_a_checkpoint_of_another_model_is_refused_naming_the_differences_and_nothing_is_loaded(tmp_path):
    model, opt = fresh(0, width=16)
    with Checkpointer(tmp_path, every=1, fingerprint='{"width": 16}') as ckpt:
        train(model, opt, 0, 1, ShardSampler(64, 1, 0), ckpt)
    other, other_opt = fresh(3, width=32)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointMismatch) as err:
        Checkpointer(tmp_path, every=1, fingerprint='{"width": 16}').restore(model=other, optimizer=other_opt)
    msg = str(err.value)
    assert "shape mismatch for 'model/0.weight': checkpoint (16, 8), current (32, 8)" in msg
    assert "'model/1.running_mean'" in msg
    assert differences(before, other.state_dict()) == []  # refused before anything was loaded
    with pytest.raises(CheckpointMismatch, match="width: checkpoint 16, current 32"):
        Checkpointer(tmp_path, every=1, fingerprint='{"width": 32}').restore(model=model)
    with pytest.raises(CheckpointMismatch, match="saved without strategy="):
        Checkpointer(tmp_path, every=1, fingerprint='{"width": 16}').restore(model=model, strategy=Stack())


def test_asynchronous_saves_become_durable_by_close(tmp_path):
    model, opt = fresh(0)
    ckpt = Checkpointer(tmp_path, every=2)
    store = ckpt.driver._by_name["local"].store
    real_save = store.save

    def slow_save(*args, **kwargs):  # a slow disk: the persist is still running when maybe_save returns
        time.sleep(0.5)
        return real_save(*args, **kwargs)

    store.save = slow_save
    sampler = ShardSampler(64, 1, 0)
    train(model, opt, 0, 1, sampler, ckpt)
    assert not ckpt.maybe_save(1, model=model, optimizer=opt)  # not due
    train(model, opt, 1, 2, sampler)
    assert ckpt.maybe_save(2, model=model, optimizer=opt)
    assert store.latest_step() is None  # snapshot taken, persist in flight
    ckpt.close()
    assert store.latest_step() == 2 and store.verify(2) == []
    loaded = CheckpointStore(tmp_path, clean=False).load().tree
    assert differences(loaded["model"], model.state_dict()) == [] and loaded["step"] == 2


def test_restore_with_no_checkpoint_returns_none_and_changes_nothing(tmp_path):
    model, opt = fresh(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert Checkpointer(tmp_path / "none", every=5).restore(model=model, optimizer=opt) is None
    assert differences(before, model.state_dict()) == [] and opt.state_dict()["state"] == {}


def test_explicit_save_writes_the_final_step_once(tmp_path):
    model, opt = fresh(0)
    with Checkpointer(tmp_path, every=10) as ckpt:
        train(model, opt, 0, 3, ShardSampler(64, 1, 0), ckpt)
        assert ckpt.save(3, model=model, optimizer=opt)
        assert not ckpt.save(3, model=model, optimizer=opt)  # already there
    assert CheckpointStore(tmp_path, clean=False).steps() == [3]


def test_bad_settings_name_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="needs an interval"):
        Checkpointer(tmp_path)
    with pytest.raises(ValueError, match="needs a directory"):
        Checkpointer("", every=3)
    with pytest.raises(ValueError, match="leave every=0"):
        CheckpointSettings(dir="d", every=5, policy=AutoInterval())
    with pytest.raises(TypeError, match="parse_policy"):
        CheckpointSettings(dir="d", policy="auto")
    with pytest.raises(ValueError, match="remote_dir and remote_every go together"):
        CheckpointSettings(dir="d", every=1, remote_every=3)
    with pytest.raises(ValueError, match="memory_every > 0"):
        CheckpointSettings(dir="d", every=1, memory_peer=True)
    with pytest.raises(ValueError, match="bound is a fraction"):
        AutoInterval(bound=2.0)
    with pytest.raises(ValueError, match="step is the number of optimizer steps"):
        Checkpointer(tmp_path, every=1).maybe_save(-1, model=net())


def test_the_loop_state_is_a_training_state():
    state = LoopState(World.single(), 3, 0.5, net(), data=ShardSampler(10, 0, 0))
    assert isinstance(state, TrainingState) and state.shard_items == 10


# ---- the driver and resume without a trainer ------------------------------------------------------------


def test_policy_text_round_trips_and_the_auto_policy_saves_first_at_its_first_step(tmp_path):
    policy = parse_policy("auto:bound=0.05,devices=8,first=3")
    assert policy == AutoInterval(bound=0.05, devices=8, first=3) and parse_policy(format_policy(policy)) == policy
    assert parse_policy("") is None
    with pytest.raises(
        ValueError,
        match=r"does not take bnd \(did you mean bound\?\); its parameters: bound, mtbf_days, devices, first, max",
    ):
        parse_policy("auto:bnd=0.1")
    model, opt = fresh(0)
    with Checkpointer(tmp_path, policy=AutoInterval(first=3)) as ckpt:
        train(model, opt, 0, 4, ShardSampler(64, 1, 0), ckpt)
        rec = ckpt.record()
    assert rec["saves"] == {"local": 1} and rec["last_saved_step"] == 3
    assert rec["policy"]["spec"] == format_policy(AutoInterval(first=3)) and rec["decision"]["step"] == 3


class _State:
    """A minimal TrainingState: a replicated model entry, a data position, per-rank RNG."""

    def __init__(self, world, shard_items: int, data, rank_tag: int = 0):
        self.world, self.shard_items, self.step, self.elapsed = world, shard_items, 0, 0.0
        self.model = nn.Linear(2, 2)
        with torch.no_grad():  # the same on every rank: replicated
            self.model.weight.copy_(torch.arange(4.0).view(2, 2))
            self.model.bias.fill_(0.5)
        self.data, self.rank_tag, self.loaded = data, rank_tag, None

    def model_state_dict(self) -> dict:
        return self.model.state_dict()

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "model": self.model_state_dict(),
            "optimizer": {"lr": 0.1},
            "strategy": {},
            "data": self.data,
            "rng": {"tag": torch.tensor([self.rank_tag])},
        }

    def load_state_dict(self, tree: dict) -> None:
        self.loaded = tree


def _save_two_ranks(root, data: list, fingerprint: str) -> None:
    """Step 6 of a 2-rank job, each rank's part written by a thread through the driver's tree."""
    import threading

    from islands.checkpoint.policy.driver import CheckpointDriver

    barrier = threading.Barrier(2, timeout=20)
    errors = []

    class _World(World):
        def all_gather_object(self, obj):  # only the barrier of the stores meets here
            barrier.wait()
            return [obj, obj]

    def rank_main(rank):
        try:
            world = _World(rank=rank, size=2, islands=1, device=torch.device("cpu"), backend="none", comms={})
            state = _State(world, 10, data[rank], rank_tag=rank)
            state.step = 6
            driver = CheckpointDriver(
                CheckpointSettings(dir=root, every=3, asynchronous=False, share_replicas=False),
                world,
                fingerprint=fingerprint,
            )
            barrier.wait()  # rank 0's store removes partial saves when it opens: before any rank saves
            driver.after_step(state)
            driver.wait()
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_resume_two_saved_ranks_into_one_rescales_loader_positions_and_keeps_other_data_forms(tmp_path):
    fp = fingerprint_of({"width": 2})
    _save_two_ranks(tmp_path / "a", [{"epoch": 1, "cursor": 2}, {"epoch": 1, "cursor": 6}], fp)
    state = _State(World.single(), 20, None)
    info = resume(state, tmp_path / "a", fingerprint=fp)
    assert info["step"] == 6 and info["resharded"] and info["saved_world_size"] == 2
    # mean progress 1.4 epochs of the saved shards, placed on this rank's shard of 20 items
    assert state.loaded["data"] == {"epoch": 1, "cursor": 8} and state.loaded["step"] == 6
    assert int(state.loaded["rng"]["tag"]) == 0  # rank r mod N's part

    _save_two_ranks(tmp_path / "b", [{"pos": 3}, {"pos": 9}], fp)
    state = _State(World.single(), 20, None)
    info = resume(state, tmp_path / "b", fingerprint=fp)
    assert state.loaded["data"] == {"pos": 3} and "as it was" in info["data_policy"]

    check_resume(tmp_path / "a", fp)
    with pytest.raises(ValueError, match="width: checkpoint 2, current 3"):
        check_resume(tmp_path / "a", fingerprint_of({"width": 3}))
    with pytest.raises(CheckpointMismatch, match="width: checkpoint 2, current '<absent>'"):
        resume(_State(World.single(), 20, None), tmp_path / "a", fingerprint="")
