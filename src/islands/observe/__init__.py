"""Seeing a run: loggers (TensorBoard, MLflow, W&B, the live JSON-lines stream) fed by the Logging callback.

    from islands.observe import Logging, JsonLines, TensorBoard
    trainer = Trainer(..., callbacks=[Logging([JsonLines("runs/mine/live/rank0.jsonl"),
                                               TensorBoard("runs/mine/tb/rank0")])])

TensorBoard, MLflow and Wandb load their packages (pip install 'islands[loggers]') only when constructed.
docs/observe.md: what each shows, the metric names, how to read them back.
"""

from islands.observe.backends import build_loggers, parse_logger_names
from islands.observe.callback import Logging
from islands.observe.logger import JsonLines, Logger, flatten, read_lines
from islands.observe.mlflow import MLflow
from islands.observe.tensorboard import TensorBoard
from islands.observe.wandb import Wandb

__all__ = [
    "JsonLines",
    "Logger",
    "Logging",
    "MLflow",
    "TensorBoard",
    "Wandb",
    "build_loggers",
    "flatten",
    "parse_logger_names",
    "read_lines",
]
