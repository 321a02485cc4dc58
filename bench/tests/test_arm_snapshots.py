"""A simulated scale-sweep arm cut mid-run resumes from its snapshots (--reuse) and ends bit for bit where the
uninterrupted arm ends: loss, bytes and calls (issue #18: long arms survive across sessions)."""

import pytest
import torch

import islands
from islands.tasks import lm_task
from islands_bench.experiments.arm_snapshots import ArmSnapshots
from islands_bench.experiments.scale_sweep import _fit

TIER = dict(islands=2, steps=48, H=8, lr=3e-3)
EVERY = 8  # every round


class Crash(RuntimeError):
    pass


class _CrashAt:
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, loss):
        if trainer.step == self.step and trainer.world.rank == 1:
            raise Crash(f"cut at step {self.step}")


def _task():
    return lm_task(d_model=16, n_layers=1, n_heads=2, context=16, batch_size=4, eval_batches=2, seed=0)


def _run(arm, snapshots=None, callbacks=()):
    task = _task()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return islands.simulate.run(lambda w: _fit(task, w, arm, TIER, snapshots, callbacks), islands=TIER["islands"])
    finally:
        torch.set_num_threads(threads)


def _counts(result):
    ledger = result["ledger"]
    return {k: ledger[k] for k in ("sent", "received", "calls")}


@pytest.mark.parametrize("arm", ["diloco", "streaming"])
def test_a_cut_arm_resumes_from_its_last_complete_snapshot_bit_for_bit(tmp_path, arm):
    whole = _run(arm)
    spec = {"arm": arm, "tier": TIER}
    root = tmp_path / "arm.snapshots"
    first = ArmSnapshots(root, EVERY, TIER["islands"], spec)
    assert first.prepare(reuse=True) is None  # nothing to resume: a fresh directory holding the spec
    with pytest.raises(RuntimeError, match="cut at step 44"):
        _run(arm, first, callbacks=[_CrashAt(44)])
    # island 1 was cut mid-round; both islands wrote step 40 before the round's exchange, and each kept one set
    # before it (a complete set at every moment), deleting the older ones
    assert first.complete(40) and first.complete(32) and not (root / "step24").exists()
    again = ArmSnapshots(root, EVERY, TIER["islands"], spec)
    assert again.prepare(reuse=True) == 40
    resumed = _run(arm, again)
    assert again.wall_before > 0  # the earlier session's wall time, read back with island 0's state
    assert resumed[0]["val_loss"] == whole[0]["val_loss"]  # bit for bit
    for a, b in zip(resumed, whole):
        assert a["train_loss"] == b["train_loss"]
        assert _counts(a) == _counts(b)  # the ledger's counts carried over: bytes of the whole arm


def test_a_changed_spec_or_no_reuse_starts_the_arm_afresh(tmp_path):
    root = tmp_path / "arm.snapshots"
    spec = {"arm": "diloco", "tier": TIER}
    snaps = ArmSnapshots(root, EVERY, TIER["islands"], spec)
    snaps.prepare(reuse=True)
    with pytest.raises(RuntimeError, match="cut at step 44"):
        _run("diloco", snaps, callbacks=[_CrashAt(44)])
    assert snaps.complete(40)
    other = ArmSnapshots(root, EVERY, TIER["islands"], {**spec, "arm": "streaming"})
    assert other.prepare(reuse=True) is None and not snaps.complete(40)  # another spec: deleted
    with pytest.raises(RuntimeError, match="cut at step 44"):
        _run("diloco", snaps, callbacks=[_CrashAt(44)])
    assert ArmSnapshots(root, EVERY, TIER["islands"], spec).prepare(reuse=False) is None  # no --reuse: deleted
    assert not any(root.glob("step*"))
    # an incomplete set (one island's file missing) is passed over for the complete one before it
    snaps = ArmSnapshots(root, EVERY, TIER["islands"], spec)
    snaps.prepare(reuse=True)
    with pytest.raises(RuntimeError, match="cut at step 44"):
        _run("diloco", snaps, callbacks=[_CrashAt(44)])
    (root / "step40" / "island1.pt").unlink()
    assert ArmSnapshots(root, EVERY, TIER["islands"], spec).prepare(reuse=True) == 32
    with pytest.raises(ValueError, match="interval must be > 0"):
        ArmSnapshots(root, 0, 2, spec)
