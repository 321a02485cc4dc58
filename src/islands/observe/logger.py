"""The logger protocol: where a run's numbers go besides run.json (islands.observe.callback feeds them).

A logger is any object with these four methods (TensorBoard, MLflow, W&B and the live JSON-lines stream
the dashboard reads are the implementations islands ships):

    log_params(params)           once per run: the configuration, interconnect, baseline, world (flat str->scalar)
    log_metrics(metrics, step)   name -> float at a training step; names are "section/what[/kind]"
    log_event(event, step)       a membership change or a checkpoint save (a flat dict with a "type")
    close()                      flush and release files

One logger serves one process (rank); the same names arrive at every backend, so they can be compared.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Protocol, TextIO, runtime_checkable


@runtime_checkable
class Logger(Protocol):
    def log_params(self, params: dict) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_event(self, event: dict, step: int) -> None: ...

    def close(self) -> None: ...


def flatten(tree: dict, prefix: str = "", sep: str = ".") -> dict:
    """{"train": {"lr": 3e-4}} -> {"train.lr": 3e-4}; lists and other values become their JSON text."""
    flat: dict = {}
    for key, value in tree.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, dict):
            flat.update(flatten(value, name, sep))
        elif value is None or isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, default=str)
    return flat


def finite(metrics: dict) -> dict[str, float]:
    """Only real numbers: loggers refuse None, and NaN would break charts."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(float(value)):
            out[key] = float(value)
    return out


def needs(package: str, logger: str) -> ImportError:
    """The error a backend raises when its package is missing: what to install."""
    return ImportError(
        f"the {logger} logger needs the {package} package: pip install 'islands[loggers]' (or pip install {package})"
    )


class JsonLines:
    """The live stream: one JSON object per line, flushed as written, so a reader (the dashboard) sees a run
    while it goes. Lines: {"kind": "params"|"metrics"|"event", "t": unix time, "step": ..., ...}."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # held open across writes; close() closes it
        self._file: TextIO | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def _write(self, line: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps({"t": time.time(), **line}, default=str) + "\n")
        self._file.flush()

    def log_params(self, params: dict) -> None:
        self._write({"kind": "params", "params": params})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._write({"kind": "metrics", "step": int(step), "metrics": metrics})

    def log_event(self, event: dict, step: int) -> None:
        self._write({"kind": "event", "step": int(step), "event": event})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_lines(path: str | Path) -> list[dict]:
    """A stream's complete lines, as the dashboard reads them: a line still being written is left for the next
    read, and a damaged complete line (a writer killed mid-line, then restarted) is skipped, not the end."""
    out = []
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                line = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(line, dict):
                out.append(line)
    return out
