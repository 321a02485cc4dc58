"""The loggers a job can name (`--log tensorboard,mlflow,wandb`) and where each writes under the run directory:

    <run_dir>/tb/<stream>/                  TensorBoard event files, one directory per stream
    <run_dir>/mlruns/                       an MLflow file store: one experiment (the job), one run per stream
    <run_dir>/wandb/offline-run-*/          W&B offline runs, one per stream, grouped by the job

A stream is one process's series: "rank<r>", or an elastic member's name. Importing this module loads none of
the logging packages; each loads when its logger is built.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path

from islands.observe.logger import Logger
from islands.observe.mlflow import MLflow
from islands.observe.tensorboard import TensorBoard
from islands.observe.wandb import Wandb

Factory = Callable[[Path, str, str, dict], Logger]


def _tensorboard(run_dir: Path, stream: str, job: str, params: dict) -> Logger:
    logger = TensorBoard(Path(run_dir) / "tb" / stream)
    if params:
        logger.log_params(params)
    return logger


def _mlflow(run_dir: Path, stream: str, job: str, params: dict) -> Logger:
    logger = MLflow(
        Path(run_dir) / "mlruns", experiment=job, run_name=stream, tags={"islands.stream": stream, "islands.job": job}
    )
    if params:
        logger.log_params(params)
    return logger


def _wandb(run_dir: Path, stream: str, job: str, params: dict) -> Logger:
    return Wandb(run_dir, project="islands", group=job, name=stream, config=params)


LOGGERS: dict[str, Factory] = {"tensorboard": _tensorboard, "mlflow": _mlflow, "wandb": _wandb}
# the module each needs (what validation looks for before any worker starts) and the package that installs it
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow-skinny"),
    "wandb": ("wandb", "wandb"),
}


def parse_logger_names(text: str | list | tuple | None) -> list[str]:
    """ "tensorboard,mlflow" -> ["tensorboard", "mlflow"] (order kept, repeats dropped; "" and "none": no
    logger). An unknown name is a ValueError listing the valid ones."""
    if text is None:
        return []
    parts = text if isinstance(text, (list, tuple)) else str(text).split(",")
    names: list[str] = []
    for part in parts:
        name = str(part).strip().lower()
        if name in ("", "none"):
            continue
        if name not in LOGGERS:
            close = difflib.get_close_matches(name, list(LOGGERS), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(
                f"unknown logger {name!r}{hint}; choose from {', '.join(LOGGERS)}, comma-separated "
                "(e.g. tensorboard,mlflow)"
            )
        if name not in names:
            names.append(name)
    return names


def missing_packages(names: list[str]) -> list[str]:
    """The loggers among `names` whose package is not installed, each as "name (pip package)"."""
    return [f"{n} ({PACKAGES[n][1]})" for n in names if find_spec(PACKAGES[n][0]) is None]


def stream_name(text: str) -> str:
    """A stream name usable as a directory and a run name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(text)) or "stream"


def build_loggers(names: str | list, run_dir: str | Path, stream: str, job: str, params: dict | None = None) -> list:
    """The named loggers for one stream of a job, laid out under run_dir (module docstring)."""
    return [LOGGERS[name](Path(run_dir), stream, job, dict(params or {})) for name in parse_logger_names(names)]
