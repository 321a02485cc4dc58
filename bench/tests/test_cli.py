"""`islands bench` reaches islands' CLI through the islands.commands entry point, not through an import."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from islands.cli import build_parser, main


def test_the_bench_registers_its_command_in_the_entry_point_group():
    names = {e.name: e.value for e in entry_points(group="islands.commands")}
    assert names.get("bench") == "islands_bench.cli:add_command"
    args = build_parser().parse_args(["bench", "ddp-scaling", "--quick", "--out", "/tmp/x"])
    assert (args.name, args.quick, args.out) == ("ddp-scaling", True, "/tmp/x")
    assert args.fn.__module__ == "islands_bench.cli"


def test_an_unknown_experiment_exits_2_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "no-such-experiment"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown experiment 'no-such-experiment'" in err and "ddp-scaling" in err


@pytest.mark.integration  # the CLI as a subprocess
def test_islands_bench_list_runs_as_a_command():
    out = subprocess.run(
        [sys.executable, "-m", "islands", "bench", "--list"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "ddp-scaling" in out.stdout and "ckpt-crash" in out.stdout
