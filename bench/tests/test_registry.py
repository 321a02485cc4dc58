"""The experiment registry: names, practice ids and devices agree with the practice registry."""

from __future__ import annotations

import pytest

from islands.practices import load_practices
from islands_bench import harness


def test_named_experiments_are_registered_benches_for_that_practice():
    # The bench harness registers experiments with the practice ids they test; the two must agree.
    practices = load_practices()
    experiments = harness.load_all()
    for p in practices:
        assert p.experiment == (p.experiments[0] if p.experiments else "")
        for name in p.experiments:  # every experiment a row names, the one that tests its claim first
            assert name in experiments, f"{p.id}: no bench experiment named {name!r}"
            assert p.id in experiments[name].practices, f"{name} does not declare {p.id}"
    ids = {p.id for p in practices}
    for exp in experiments.values():
        assert set(exp.practices) <= ids, f"bench {exp.name} cites unknown practice ids"


def test_the_gpu_and_scale_benches_are_named_by_the_practices_they_measure():
    """gpu-throughput (bf16 loop cost, DiLoCo on one GPU), scale-sweep (DiLoCo's gap over model sizes) and
    compressor-scale (the outer codecs' GB/s: topkq, dct-topk, error feedback, Elias-Fano positions), issue #34."""
    by_id = {p.id: p for p in load_practices()}
    named = {
        "gpu-throughput": ("SOTA-118", "SOTA-155"),
        "scale-sweep": ("SOTA-155",),
        "compressor-scale": ("SOTA-902", "SOTA-903", "SOTA-214", "SOTA-905"),
    }
    experiments = harness.load_all()
    for name, ids in named.items():
        assert set(experiments[name].practices) == set(ids), name
        for pid in ids:
            assert name in by_id[pid].experiments, (pid, name)
    # the experiment that first tested each claim stays first
    assert by_id["SOTA-118"].experiment == "memory-savers" and by_id["SOTA-155"].experiment == "diloco-vs-ddp"
    assert by_id["SOTA-214"].experiment == "ef-ablation"
    assert {by_id[i].experiment for i in ("SOTA-902", "SOTA-903", "SOTA-905")} == {"outer-compression"}


def test_compression_experiments_registered_with_their_practices():
    reg = harness.load_all()
    expect = {
        "ef-ablation": "SOTA-214",
        "sparsity-warmup": "SOTA-224",
        "onebit-adam": "SOTA-215",
        "compression-vs-bandwidth": "SOTA-075",
        "compressor-throughput": "SOTA-075",
    }
    for name, practice in expect.items():
        assert practice in reg[name].practices, (name, reg[name].practices)


def test_bench_device_must_be_one_the_experiment_declares(tmp_path):
    with pytest.raises(KeyError, match=r"cpu only.*compressor-throughput"):
        harness.run("ckpt-codec", quick=True, out_root=tmp_path, device="cuda")
    assert not (tmp_path / "ckpt-codec").exists()  # refused before anything is written
    assert "cuda" in harness.load_all()["compressor-throughput"].devices
