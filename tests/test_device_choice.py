"""Choosing CPU+gloo or CUDA+NCCL per worker (the bench's --device switch: bench/tests/test_registry.py)."""

import pytest
import torch

from islands.app.validate import validate
from islands.config import ConfigError, from_mapping
from islands.runtime.world import pick_backend


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_auto_takes_gloo_on_cpu_when_workers_outnumber_gpus(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(_gpus() + 1))
    assert pick_backend("auto") == ("gloo", torch.device("cpu"))
    assert pick_backend("cpu") == ("gloo", torch.device("cpu"))


def test_cuda_refused_with_a_reason_when_gpus_are_short(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(_gpus() + 1))
    with pytest.raises(ValueError, match="one GPU per worker"):
        pick_backend("cuda")
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        pick_backend("gpu")


def test_config_rejects_cuda_without_enough_gpus_and_unknown_devices(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="one GPU per local worker"):
        validate(from_mapping({"device": "cuda", "workers": _gpus() + 1, "global_batch": 8 * (_gpus() + 1)}))
    with pytest.raises(ConfigError, match="auto, cpu, cuda"):
        validate(from_mapping({"device": "tpu"}))
    assert validate(from_mapping({"device": "cpu"})).world.device == "cpu"
