"""The wired robust path through the real Trainer: 4 gloo ranks train digits under attack.

One spawn of 4 processes runs every scenario in turn (each a fresh Trainer over the same process
group, so the suite pays for one start-up) and ships every rank's final parameters back; the tests
compare them. (The bench's in-process simulation is checked against a real run in bench/tests.)
"""

from __future__ import annotations

import os
import traceback

import numpy as np
import pytest
import torch

from harness.world import spawn_ranks

WORLD, STEPS, DELAY = 4, 4, 0.25
ROBUST = [
    "median",
    "trimmed-mean:beta=0.25",
    "krum:f=1",
    "multi-krum:f=1,m=2",
    "geomed",
    "cclip:tau=0.5",
    "nnm:f=1+median",
    "bucketing:s=2+median",
]
TINY = dict(
    task="digits",
    workers=WORLD,
    steps=STEPS,
    global_batch=16,
    hidden=16,
    warmup=1,
    eval_every=0,
    eval_batches=1,
    log_every=STEPS,
    probe=False,
    progress=False,
    timeout=30.0,
)

# label -> (aggregate, attack, extra config)
SCENARIOS: dict[str, tuple[str, str, dict]] = {
    "sign-flip/median": ("median", "sign-flip:count=1", {}),
    **{f"nan/{spec}": (spec, "nan:count=1", {}) for spec in ROBUST},
    "inf/median": ("median", "inf:count=1", {}),
    "nan/mean": ("mean", "nan:count=1", {}),  # the mean also sits behind the NaN/Inf front door
    # A bucket of 2 KB splits this 1.7 K-parameter MLP into several DDP buckets: per-bucket state.
    "buckets/cclip+stale-dropout": ("cclip:tau=0.5", "dropout:mode=stale,count=1", {"bucket_mb": 0.002}),
    "clean/median": ("median", "", {}),
    "straggler/median": ("median", f"straggler:delay={DELAY},count=1", {}),
}


def _config(aggregate: str, attack: str, extra: dict):
    from islands.app.validate import validate
    from islands.config import from_mapping

    return validate(from_mapping({**TINY, "aggregate": aggregate, "attack": attack, **extra}))


def _worker(rank: int, env: dict, queue) -> None:
    os.environ.update(env, RANK=str(rank))
    try:
        from islands.app.build import build_trainer
        from islands.runtime.world import close_world, init_world

        world = init_world(islands=1, timeout_s=30)
        out = {}
        for label, (aggregate, attack, extra) in SCENARIOS.items():
            cfg = _config(aggregate, attack, extra)
            trainer = build_trainer(cfg, world, run_dir=None)
            record = trainer.fit(cfg.train.steps)
            params = [p.detach().numpy().copy() for p in trainer.strategy.eval_model(trainer.model).parameters()]
            out[label] = {
                "params": params,
                "steps": trainer.step,
                "elapsed": trainer.elapsed,
                "loss": record["summary"]["final_val_loss"],
            }
        close_world(world)
        queue.put((rank, out))
    except Exception:  # noqa: BLE001 - the parent shows the rank's traceback
        queue.put((rank, traceback.format_exc()))


@pytest.fixture(scope="module")
def results() -> dict[int, dict]:
    got = dict(spawn_ranks(_worker, WORLD, timeout=240))
    failed = {r: v for r, v in got.items() if isinstance(v, str)}
    assert not failed, "\n".join(f"rank {r}:\n{tb}" for r, tb in failed.items())
    return got


def _same_bits(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(a, b))


def test_median_under_sign_flip_leaves_every_rank_with_bitwise_identical_parameters(results):
    base = results[0]["sign-flip/median"]["params"]
    assert all(np.isfinite(p).all() for p in base)
    for rank in range(1, WORLD):
        assert _same_bits(base, results[rank]["sign-flip/median"]["params"]), f"rank {rank} differs from rank 0"
    # Training moved the parameters (the identity is not that of an untouched model).
    torch.manual_seed(0)
    from islands.models import MLP

    init = [p.detach().numpy() for p in MLP(64, TINY["hidden"], 10).parameters()]
    assert not _same_bits(base, init)


@pytest.mark.parametrize("label", [f"nan/{s}" for s in ROBUST] + ["inf/median", "nan/mean"])
def test_non_finite_attack_never_reaches_any_rank_parameters(results, label):
    for rank in range(WORLD):
        run = results[rank][label]
        assert run["steps"] == STEPS
        assert all(np.isfinite(p).all() for p in run["params"]), f"rank {rank} holds NaN/Inf under {label}"
        assert np.isfinite(run["loss"])
        assert _same_bits(results[0][label]["params"], run["params"])


def test_stateful_aggregator_and_attack_work_across_several_buckets(results):
    for rank in range(WORLD):
        run = results[rank]["buckets/cclip+stale-dropout"]
        assert run["steps"] == STEPS and all(np.isfinite(p).all() for p in run["params"])
        assert _same_bits(results[0]["buckets/cclip+stale-dropout"]["params"], run["params"])


def test_straggler_delays_every_rank_but_training_completes(results):
    for rank in range(WORLD):
        slow, clean = results[rank]["straggler/median"], results[rank]["clean/median"]
        assert slow["steps"] == STEPS
        # Honest ranks wait for the straggler inside the all-gather, so everyone pays its delay.
        assert slow["elapsed"] >= STEPS * DELAY * 0.9, (rank, slow["elapsed"])
        # A straggler sends honest values: the result equals the clean run's, bit for bit.
        assert _same_bits(slow["params"], clean["params"])
