"""Choosing CPU+gloo or CUDA+NCCL per worker (the bench's --device switch: bench/tests/test_registry.py)."""

import pytest
import torch

from islands.app.validate import validate
from islands.config import ConfigError, from_mapping
from islands.runtime.world import pick_backend

# Every case here reads the host's GPU count: on a GPU machine they check the paths CI never takes (scripts/gpu-check).
pytestmark = pytest.mark.cuda


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


def test_a_job_started_without_local_world_size_counts_its_world_as_one_host(monkeypatch):
    """Processes that set RANK/LOCAL_RANK/WORLD_SIZE by hand (no LOCAL_WORLD_SIZE): on a host with fewer GPUs than
    workers, every one of them takes gloo on the CPU; none asks for a GPU index the host lacks."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    workers = _gpus() + 1
    monkeypatch.setenv("WORLD_SIZE", str(workers))
    for rank in range(workers):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        assert pick_backend("auto") == ("gloo", torch.device("cpu"))
        with pytest.raises(ValueError, match="one GPU per worker"):
            pick_backend("cuda")
    # a LOCAL_RANK past LOCAL_WORLD_SIZE (a wrong launcher) is not a GPU index either
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", str(_gpus()))
    assert pick_backend("auto") == ("gloo", torch.device("cpu"))
