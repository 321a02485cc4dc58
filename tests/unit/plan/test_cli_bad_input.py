"""islands plan: bad input exits 2 with what would be right, and no traceback."""

import pytest

from islands.cli import main


def _run(capsys, *argv) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(["plan", "--task", "digits", "--workers", "2", "--islands", "2", *argv])
    err = capsys.readouterr().err
    return int(e.value.code or 0), err


def test_unknown_strategy_lists_the_choices(capsys):
    code, err = _run(capsys, "--strategy", "warp-drive")
    assert code == 2
    assert "warp-drive" in err and "ddp, zero1, fsdp" in err and "diloco" in err
    assert "Traceback" not in err


def test_link_that_does_not_parse(capsys):
    code, err = _run(capsys, "--link", "100furlongs")
    assert code == 2 and "100furlongs" in err and "'1gbit,5ms'" in err and "Traceback" not in err


def test_model_that_does_not_build(capsys, tmp_path, monkeypatch):
    (tmp_path / "broken_task.py").write_text("def make_task(cfg):\n    raise RuntimeError('no such layer')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as e:
        main(["plan", "--task", "broken_task:make_task", "--workers", "2", "--islands", "2", "--link", "1gbit"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no such layer" in err and "Traceback" not in err
