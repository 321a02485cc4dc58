"""`islands train --aggregate/--attack` with a bad spec: exit code 2 before any worker starts, naming the choices."""

from __future__ import annotations

import subprocess
import sys

import pytest

ISLANDS = [
    sys.executable,
    "-m",
    "islands",
    "train",
    "--task",
    "digits",
    "--workers",
    "4",
    "--steps",
    "2",
    "--no-progress",
]


@pytest.mark.parametrize(
    "flag, spec, must_say",
    [
        ("--aggregate", "bogus", ["unknown aggregator 'bogus'", "valid: mean, median", "krum:f=<int>", "nnm:f="]),
        (
            "--attack",
            "sign-flop:count=1",
            ["unknown attack 'sign-flop'", "did you mean 'sign-flip'", "alie", "label-flip", "sign-flip:count="],
        ),
    ],
)
def test_bad_spec_exits_2_and_lists_the_valid_choices(tmp_path, flag, spec, must_say):
    run_dir = tmp_path / "run"
    out = subprocess.run([*ISLANDS, flag, spec, "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, (out.returncode, out.stderr)
    for text in must_say:
        assert text in out.stderr, (text, out.stderr)
    assert not (run_dir / "logs").exists()  # rejected before any worker was started
