"""The training loop of objects: Trainer, Task, callbacks, schedules, evaluation."""

# Their public home is the top level (islands.Trainer, islands.Callback, ...): one home per name
# (tests/unit/project/test_public_homes.py). The imports stay for the package's own modules and older internal imports.
from islands.loop.callbacks import (  # noqa: F401 - see above
    Callback,
    Checkpointing,
    Evaluate,
    Progress,
    RunRecord,
    SaveModel,
)
from islands.loop.evaluate import evaluate  # noqa: F401 - see above
from islands.loop.schedule import Constant, WarmupCosine  # noqa: F401 - see above
from islands.loop.task import Task  # noqa: F401 - see above
from islands.loop.trainer import Trainer  # noqa: F401 - see above

__all__: list[str] = []
