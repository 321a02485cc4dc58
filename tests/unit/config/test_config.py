import pytest

from islands.app.validate import validate
from islands.cli import main
from islands.config import ConfigError, JobConfig, from_mapping


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    return e.value.code, capsys.readouterr().err


def test_unknown_key_names_it_and_suggests(tmp_path, capsys):
    cfg = tmp_path / "job.toml"
    cfg.write_text("workrs = 4\n")
    code, err = run_cli(["train", "--config", str(cfg)], capsys)
    assert code == 2
    assert "workrs" in err and "did you mean workers" in err


def test_wrong_type_in_toml(tmp_path, capsys):
    cfg = tmp_path / "job.toml"
    cfg.write_text('steps = "many"\n')
    code, err = run_cli(["train", "--config", str(cfg)], capsys)
    assert code == 2 and "steps must be int" in err


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--workers", "3", "--global-batch", "32"], "divisible by world.workers"),
        (["--workers", "4", "--islands", "3"], "divisible by world.islands"),
        (["--task", "images"], "task.name must be lm, digits"),
        (["--d-model", "130", "--n-heads", "4"], "divisible by task.n_heads"),
        (["--workers", "4", "--islands", "2"], "needs an outer strategy"),
        (["--data", "/nonexistent/corpus.txt"], "does not exist"),
    ],
)
def test_impossible_combinations_exit_2_before_workers(args, needle, capsys, tmp_path):
    code, err = run_cli(["train", "--run-dir", str(tmp_path / "r"), *args], capsys)
    assert code == 2
    assert needle in err
    assert not (tmp_path / "r").exists()  # nothing started, nothing written


def test_flags_override_toml(tmp_path):
    from islands.cli import build_parser, config_from_args

    f = tmp_path / "job.toml"
    f.write_text("steps = 10\nworkers = 2\n")
    args = build_parser().parse_args(["train", "--config", str(f), "--steps", "7"])
    cfg = config_from_args(args)
    assert cfg.train.steps == 7 and cfg.world.workers == 2


def test_bool_is_not_an_int():
    with pytest.raises(ConfigError, match="steps must be int"):
        from_mapping({"steps": True})


def test_defaults_validate():
    assert validate(JobConfig()).inner_strategy == "ddp"
