"""Two one-worker islands of a FIXED world sharing one GPU (issue #34 item 6), skipped without CUDA: `islands train
--device cuda --workers 2 --islands 2` with DiLoCo. NCCL refuses two ranks of one group on one device, so the world
is planned as runtime.world.plan_groups says: each island a NCCL group of its own ranks (here a group of one), the
default group and the cross group gloo, the outer deltas staged through host buffers. The same job on the CPU is the
reference: the same bytes across islands, and in fp32 the same loss up to the kernels' rounding. The groups' choice
is tested on the CPU in tests/unit/runtime/test_group_plan.py, their construction in test_island_groups_apart.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

JOB = [
    "--workers",
    "2",
    "--islands",
    "2",
    "--outer",
    "diloco:inner_steps=3",
    "--steps",
    "6",
    "--eval-every",
    "0",
    "--log-every",
    "2",
    "--d-model",
    "64",
    "--n-layers",
    "2",
    "--global-batch",
    "8",
    "--precision",
    "fp32",
]


def _train(run: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "islands", "train", *JOB, "--run-dir", str(run), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((run / "run.json").read_text())


def test_two_single_worker_islands_share_one_gpu_nccl_inside_gloo_across(tmp_path):
    # cross_backend auto (the default) resolves to gloo here; gloo named plans the same groups (test_group_plan.py)
    gpu = _train(tmp_path / "cuda", "--device", "cuda")
    cpu = _train(tmp_path / "cpu", "--device", "cpu")
    world = gpu["world"]
    assert world["device"] == "cuda:0" and world["islands"] == 2 and world["size"] == 2
    assert world["backend"] == "gloo" and world["local_backend"] == "nccl"
    ic = gpu["interconnect"]
    assert ic["measured"] and ic["cross_backend"] == "gloo" and ic["local_backend"] == "nccl"
    assert ic["cross"]["staged_through_host"] is True  # CUDA tensors crossed through host buffers
    sent = [r["sent"] for r in gpu["comm"]["per_rank"]]
    assert sent == [r["sent"] for r in cpu["comm"]["per_rank"]]  # the same exchanges, byte for byte
    assert all(s.get("outer_delta", 0) > 0 for s in sent)
    loss, ref = gpu["summary"]["final_val_loss"], cpu["summary"]["final_val_loss"]
    assert torch.isfinite(torch.tensor(loss))
    assert loss == pytest.approx(ref, rel=1e-3)  # fp32 on both devices: the same training up to kernel rounding
