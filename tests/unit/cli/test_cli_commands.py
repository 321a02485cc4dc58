"""Subcommands other distributions add through the islands.commands entry points (islands-bench adds `bench`)."""

from __future__ import annotations

import pytest

import islands.cli as cli


class _Entry:
    name = "hello"

    @staticmethod
    def load():
        def add_command(subparsers):
            p = subparsers.add_parser("hello")
            p.set_defaults(fn=lambda args: 0)

        return add_command


def test_an_entry_point_adds_its_subcommand(monkeypatch):
    monkeypatch.setattr(cli, "entry_points", lambda group: [_Entry] if group == "islands.commands" else [])
    with pytest.raises(SystemExit) as e:
        cli.main(["hello"])
    assert e.value.code == 0


def test_without_the_benchmarks_islands_bench_says_how_to_install_them(monkeypatch, capsys):
    monkeypatch.setattr(cli, "entry_points", lambda group: [])
    for argv in (["bench", "--list"], ["bench", "ddp-scaling", "--quick"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        assert "pip install -e bench/" in capsys.readouterr().err
