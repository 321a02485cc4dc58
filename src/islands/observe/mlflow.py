"""MLflow: a local file store (a directory of plain files; no server, no database), one MLflow run per process.

    logger = MLflow("runs/mine/mlruns", experiment="mine", run_name="rank0")
    MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri runs/mine/mlruns

MLflow 3 keeps its file store in maintenance mode and refuses to open one unless MLFLOW_ALLOW_FILE_STORE is
true; this logger sets it for its own process when it is unset (a user's explicit false is left alone), and
the same variable is needed by whatever reads the store later (`mlflow ui`, a script's MlflowClient).

It talks to the store through an `MlflowClient` and an explicit run id, never MLflow's global active run, so
several of these loggers (and a user's own MLflow use) coexist in one process.

What lands where:
    metrics   every metric at its step, under its name mapped by `mlflow_key` (below).
    params    the run's parameters (keys mapped the same way); a value longer than MLflow's 6000 characters
              is cut to 5997 and ends in "..."; a parameter is logged once (MLflow's params are immutable).
    tags      islands.stream, islands.job and the caller's tags.
    artifact  events.jsonl: each membership change or checkpoint save, one JSON object a line with its step.

Names: MLflow accepts letters, digits, "_", "-", ".", " ", "/" (and ":" except on Windows), at most 250
characters, and no path segment that is empty, "." or "..". `mlflow_key` replaces every other character
(":" too, so a store reads the same everywhere) by "_", such a segment by "_", and cuts at 250 characters;
islands' own names (train/loss, comm/sent_bytes/grad_all_reduce, config.train.lr) pass unchanged.

Read back: MlflowClient("file:" + abs path).get_metric_history(run_id, "train/loss"); the run ids are
search_runs([experiment_id]) with the tag islands.stream.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from types import ModuleType

from islands.observe.logger import needs

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # Windows: no advisory locks; concurrent first runs of one experiment may then race
    fcntl = None

MAX_KEY = 250  # mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH
MAX_PARAM = 6000  # MAX_PARAM_VAL_LENGTH
MAX_TAG = 8000  # MAX_TAG_VAL_LENGTH
PARAMS_PER_BATCH, METRICS_PER_BATCH = 100, 1000
_REFUSED = re.compile(r"[^A-Za-z0-9_\-. /]")


def mlflow_key(name: str) -> str:
    """A metric or parameter name MLflow accepts (module docstring: the mapping)."""
    key = _REFUSED.sub("_", str(name))
    for _ in range(3):  # a cut can leave a new empty or dot segment at the end; settle it
        key = "/".join("_" if part in ("", ".", "..") else part for part in key.split("/"))[:MAX_KEY]
    return key


def cut(value, limit: int) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Lock:
    """An advisory lock on a file: ranks creating one experiment in one store at once would each make their own."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.file = open(self.path, "a")
        if fcntl is not None:
            fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if fcntl is not None:
            fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


class MLflow:
    def __init__(
        self,
        tracking_dir: str | Path,
        experiment: str = "islands",
        run_name: str | None = None,
        tags: dict | None = None,
    ):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # read when the client opens the store
        try:
            from mlflow.tracking import MlflowClient  # heavy, optional: imported on first use
        except ImportError as e:
            raise needs("mlflow-skinny", "MLflow") from e
        self.tracking_dir = Path(tracking_dir).resolve()
        self.tracking_dir.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = self.tracking_dir.as_uri()  # file:///abs/path
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        with _Lock(self.tracking_dir / ".islands.lock"):
            found = self.client.get_experiment_by_name(experiment)
            self.experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
            run = self.client.create_run(
                self.experiment_id,
                run_name=run_name,
                tags={mlflow_key(k): cut(v, MAX_TAG) for k, v in (tags or {}).items()},
            )
        self.run_id = run.info.run_id
        self._params: set[str] = set()
        self._events: list[str] = []
        self._open = True

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param  # loaded with the client

        new = []
        for key, value in params.items():
            k = mlflow_key(key)
            if k not in self._params:
                self._params.add(k)
                new.append(Param(k, cut("" if value is None else value, MAX_PARAM)))
        for i in range(0, len(new), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=new[i : i + PARAMS_PER_BATCH])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), float(v), now, int(step)) for k, v in metrics.items()]
        for i in range(0, len(batch), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i : i + METRICS_PER_BATCH])

    def log_event(self, event: dict, step: int) -> None:
        self._events.append(json.dumps({"step": int(step), **event}, default=str))
        self.client.log_text(self.run_id, "\n".join(self._events) + "\n", "events.jsonl")  # the file, rewritten

    def close(self) -> None:
        if self._open:
            self._open = False
            self.client.set_terminated(self.run_id, "FINISHED")
