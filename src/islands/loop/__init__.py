"""The training loop of objects: Trainer, Task, callbacks, schedules, evaluation."""

from islands.loop.callbacks import Callback, Checkpointing, Evaluate, Progress, RunRecord
from islands.loop.evaluate import evaluate
from islands.loop.schedule import Constant, WarmupCosine
from islands.loop.task import Task
from islands.loop.trainer import Trainer

# Their public home is the top level (islands.Trainer, islands.Callback, ...): one home per name
# (tests/test_public_homes.py). The imports stay for the package's own modules and older internal imports.
__all__: list[str] = []
