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
        if p.experiment:
            assert p.experiment in experiments, f"{p.id}: no bench experiment named {p.experiment!r}"
            assert p.id in experiments[p.experiment].practices, f"{p.experiment} does not declare {p.id}"
    ids = {p.id for p in practices}
    for exp in experiments.values():
        assert set(exp.practices) <= ids, f"bench {exp.name} cites unknown practice ids"


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
