"""The training loop of objects: Trainer, Task, callbacks, schedules, evaluation."""

from islands.loop.callbacks import Callback, Checkpointing, Evaluate, Progress, RunRecord
from islands.loop.evaluate import evaluate
from islands.loop.schedule import Constant, WarmupCosine
from islands.loop.task import Task
from islands.loop.trainer import Trainer

__all__ = ["Callback", "Checkpointing", "Constant", "Evaluate", "Progress", "RunRecord", "Task", "Trainer",
           "WarmupCosine", "evaluate"]
