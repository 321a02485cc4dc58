"""`islands train --aggregate/--attack` with a bad spec: exit code 2 before any worker starts, naming the choices."""

from __future__ import annotations

import pytest

from harness.cli import islands_cli

TRAIN = [
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
def test_bad_spec_exits_2_and_lists_the_valid_choices(tmp_path, flag, spec, must_say, capfd):
    run_dir = tmp_path / "run"
    code = islands_cli(*TRAIN, flag, spec, "--run-dir", str(run_dir))  # the CLI in this process (harness.cli)
    err = capfd.readouterr().err
    assert code == 2, (code, err)
    for text in must_say:
        assert text in err, (text, err)
    assert not (run_dir / "logs").exists()  # rejected before any worker was started
