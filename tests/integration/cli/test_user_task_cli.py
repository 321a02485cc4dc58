"""A user's task behind `islands train --task`: every mistake is a message naming it and exit code 2, before any
worker starts, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from islands.app.validate import validate
from islands.config import ConfigError, from_mapping

TASKS = """
import torch, torch.nn as nn, torch.nn.functional as F
import islands

def data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(8)]

def good(config):
    return islands.Task(nn.Linear(6, 3), F.cross_entropy, data())

def raises(config):
    raise RuntimeError("no GPU in this sandbox")

def wrong_type(config):
    return nn.Linear(6, 3)

def frozen(config):
    return islands.Task(nn.Linear(6, 3).requires_grad_(False), F.cross_entropy, data())

def per_sample_loss(config):
    return islands.Task(nn.Linear(6, 3), lambda p, y: F.cross_entropy(p, y, reduction="none"), data())

def wrong_width(config):
    return islands.Task(nn.Linear(5, 3), F.cross_entropy, data())

not_a_function = 3
"""


@pytest.fixture
def tasks(tmp_path):
    (tmp_path / "usertasks.py").write_text(TASKS)
    return tmp_path


def train(cwd, task: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "islands",
            "train",
            "--task",
            task,
            "--workers",
            "1",
            "--steps",
            "2",
            "--eval-every",
            "0",
            "--run-dir",
            "run",
            "--no-progress",
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "task, message",
    [
        ("nosuch.module:make_task", "module 'nosuch.module' does not import: ModuleNotFoundError"),
        ("usertasks:make_tsk", "has no 'make_tsk'"),
        ("usertasks:not_a_function", "not a function make_task(config)"),
        ("usertasks:raises", "make_task raised RuntimeError: no GPU in this sandbox"),
        ("usertasks:wrong_type", "make_task returned a Linear; it must return islands.Task"),
        ("usertasks:frozen", "has no trainable parameters"),
        ("usertasks:per_sample_loss", "loss_fn must return a scalar tensor"),
        ("usertasks:wrong_width", "could not take the batch tuple(Tensor[4, 6] float32, Tensor[4] int64)"),
        ("usertasks", "must be lm, digits, hf-causal-lm or module:function"),  # no function named
    ],
)
def test_a_bad_user_task_is_refused_before_any_worker_starts(tasks, task, message, monkeypatch):
    """The CLI's own check (islands.app.validate), in this process: every mistake is a ConfigError with its message."""
    monkeypatch.chdir(tasks)
    monkeypatch.syspath_prepend(str(tasks))
    cfg = from_mapping({"task": task, "workers": 1, "steps": 2})
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "task, message",
    [
        ("usertasks:wrong_width", "could not take the batch"),
        ("nosuch.module:make_task", "does not import"),
    ],
)
def test_the_cli_prints_it_and_exits_2_writing_nothing(tasks, task, message):
    out = train(tasks, task)
    assert out.returncode == 2, out.stderr[-2000:]
    assert message in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert not (tasks / "run").exists()  # nothing started, nothing written


def test_a_good_user_task_trains(tasks):
    out = train(tasks, "usertasks:good")
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tasks / "run" / "run.json").exists()
