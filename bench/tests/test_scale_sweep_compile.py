"""scale-sweep runs its arms compiled through the Trainer's compile= and says so (issue #34 item 6: the GPU sweep
compiled, in bf16): every row names its device, compile backend and precision; the arms run DDP and DiLoCo of every
size before the streaming ones, so a run cut by scripts/gpu-check's time box already holds whole pairs."""

from __future__ import annotations

import json

import pytest

from islands_bench import harness
from islands_bench.experiments import scale_sweep as sweep


def test_inductor_on_cuda_and_aot_eager_on_the_cpu():
    assert sweep.compile_backend("cuda") == "inductor"
    assert sweep.compile_backend("cpu") == "aot_eager"  # no C++ compiler needed; the same traced graphs
    assert sweep.PRECISION == "auto"  # bf16 autocast on a CUDA device, fp32 on the CPU (resolve_precision)


def test_pairs_of_every_size_run_before_the_streaming_arms(tmp_path, monkeypatch):
    order = []

    def fake_arm(ctx, label, spec, device):
        order.append(label)
        assert spec["compile"] == "aot_eager" and spec["precision"] == "auto" and spec["device"] == "cpu"
        loss = {"ddp": 2.0, "diloco": 2.1, "streaming": 2.2}[spec["arm"]]
        return {
            "val_loss": loss,
            "train_loss": loss,
            "wall_s": 1.0,
            "sent": 10,
            "calls": {"outer_delta": 1},
            "precision": "fp32",
            "compile": spec["compile"],
            "compile_s": 0.5,
        }

    monkeypatch.setattr(sweep, "_arm", fake_arm)
    out = harness.run("scale-sweep", quick=True, out_root=tmp_path)
    params = [int(label.split("-")[0]) for label in order]
    assert [label.split("-")[1] for label in order] == ["ddp", "diloco"] * 3 + ["streaming"] * 3
    pairs = params[:6:2]
    assert pairs == sorted(set(pairs)) and params[1:6:2] == pairs and params[6:] == pairs  # smallest first
    result = json.loads((out / "result.json").read_text())
    assert [(r["arm"], r["compiled"], r["precision"], r["device"]) for r in result["rows"][:3]] == [
        ("ddp", "aot_eager", "fp32", "cpu"),
        ("diloco", "aot_eager", "fp32", "cpu"),
        ("streaming", "aot_eager", "fp32", "cpu"),
    ]
    assert result["compile"] == "aot_eager" and result["precision"] == ["fp32"] and result["device"] == "cpu"
    assert "torch.compile aot_eager, fp32" in result["headline"][-1]


@pytest.mark.slow  # ~25 s on 2 shared cores: dynamo traces each arm's model
def test_the_smoke_tier_trains_every_arm_compiled_and_records_it(tmp_path):
    out = harness.run("scale-sweep", smoke=True, out_root=tmp_path)
    result = json.loads((out / "result.json").read_text())
    assert [r["arm"] for r in result["rows"]] == list(sweep.ARMS)
    for row in result["rows"]:
        assert row["device"] == "cpu" and row["compiled"] == "aot_eager" and row["precision"] == "fp32"
        assert row["compile_s"] is not None and row["compile_s"] >= 0
    for arm in sweep.ARMS:  # each arm compiled its own graphs (torch._dynamo.reset between arms)
        (stored,) = (out / "runs").glob(f"*-{arm}.json")
        record = json.loads(stored.read_text())
        assert record["spec"]["compile"] == "aot_eager" and record["result"]["graphs"] >= 1
