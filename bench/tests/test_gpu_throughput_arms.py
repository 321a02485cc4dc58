"""gpu-throughput's part 1 on the CPU: the compiled arms run (aot_eager here, inductor on CUDA), the second one
reuses the first's graphs, and the rows state tokens/s, MFU, the compiled cost and the 40% MFU goal."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from islands_bench.experiments import gpu_throughput as gt

TINY = dict(shape=(32, 1, 2), vocab=64, context=16, batch=2, warmup=2, steps=3, repeats=1, compiled_repeats=1)
CPU = torch.device("cpu")


def test_the_cpu_compiles_with_aot_eager_and_cuda_with_inductor():
    assert gt.compile_backend(CPU) == "aot_eager"
    assert gt.compile_backend(torch.device("cuda")) == "inductor"


def test_gpt2_asks_for_sdpa_attention():
    assert gt._gpt2(TINY, 64, 16, "meta").config._attn_implementation == "sdpa"


def test_compiled_arms_run_and_the_second_reuses_the_first_compilation():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # graphs another test of this process compiled would be reused by the first arm too
    before = counters["stats"]["unique_graphs"]
    plain = gt.plain_loop_compiled(TINY, CPU)
    after_plain = counters["stats"]["unique_graphs"]
    ours = gt.islands_loop_compiled(TINY, CPU)
    assert after_plain > before  # the plain arm compiled the model
    assert counters["stats"]["unique_graphs"] == after_plain  # islands' Trainer ran the same graphs
    assert plain.timed_s > 0 and ours.timed_s > 0 and plain.warmup_s > 0 and ours.warmup_s > 0


def test_warmup_excess_is_what_the_warmup_took_beyond_steady_steps():
    assert gt.Timing(warmup_s=5.0, timed_s=3.0).warmup_excess_s(TINY) == pytest.approx(3.0)  # 2 steps of 1 s


def _rows(seconds: dict[str, float], peak: float | None, monkeypatch):
    monkeypatch.setattr(gt, "peak_flops", lambda device: peak)  # a GPU's peak on the CPU
    times = {arm: [gt.Timing(1.0, s)] for arm, s in seconds.items()}
    return {row["arm"]: row for row in gt._loop_rows(times, TINY, CPU)}


def test_rows_state_the_compiled_cost_and_the_mfu_goal(monkeypatch):
    # milliseconds, so that tokens/s rounded to a tenth keeps the ratio's digits
    seconds = dict.fromkeys(gt.EAGER_ARMS, 2e-3) | {"plain-compiled": 1e-3, "islands-compiled": 1.01e-3}
    by_arm = _rows(seconds, 1e9, monkeypatch)
    assert gt._cost_pct(by_arm, "plain-compiled", "islands-compiled") == pytest.approx(1.0, abs=0.01)
    assert by_arm["islands-compiled"]["compile"] == "aot_eager" and by_arm["plain"]["compile"] is None
    assert by_arm["islands-compiled"]["mfu_pct"] > 0
    high = gt._mfu_phrase({"a": {"mfu_pct": 10}, "b": {"mfu_pct": 41.0}}, ("a", "b"), 1e9, goal=True)
    low = gt._mfu_phrase({"a": {"mfu_pct": 10}, "b": {"mfu_pct": 39.9}}, ("a", "b"), 1e9, goal=True)
    assert "goal >= 40%: met" in high and "not met" in low
    line = gt._loop_headline(by_arm, TINY, CPU, quick=True)[2]
    assert "islands costs +1.00% (goal <= 2%)" in line and "compiled (aot_eager" in line


def test_without_a_known_peak_no_mfu_is_stated(monkeypatch):
    by_arm = _rows(dict.fromkeys(gt.LOOPS, 1e-3), None, monkeypatch)
    assert by_arm["islands-compiled"]["mfu_pct"] is None
    assert "MFU not stated" in gt._loop_headline(by_arm, TINY, CPU, quick=True)[2]
