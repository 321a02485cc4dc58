import os
import socket

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def dist_env(monkeypatch):
    """Set torch's env:// variables for a spawned group on a free loopback port."""

    def make(world_size: int) -> dict:
        return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size)}

    return make


def pytest_configure(config):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
