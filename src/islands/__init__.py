"""islands: train PyTorch models across poorly connected, unreliable islands of devices.

One import gives what a user composes (docs/own-model.md):

    world = islands.init_world(islands=2)
    strategy = islands.Stack(inner=islands.inner.DDP(compressor=islands.compress.PowerSGD(rank=4)),
                             outer=islands.outer.DiLoCo(inner_steps=50, aggregator=islands.robust.CoordinateMedian()))
    model = strategy.wrap(model, opt, world)
    ... loss.backward(); strategy.after_backward(model, step); opt.step(); strategy.after_step(model, opt, step)
    strategy.finish(model); global_model = strategy.eval_model(model)

or `islands.Trainer(model=..., optimizer=..., loss_fn=..., train_data=..., strategy=..., world=...).fit(steps)`,
or `with strategy.attach(model, opt, world):` around an unchanged loop.
Loggers (TensorBoard, MLflow, W&B, a live JSON-lines file) are callbacks: `islands.observe.Logging([...])`.
"""

from islands import compress, control, inner, observe, optim, outer, robust
from islands.checkpoint.policy.checkpointer import Checkpointer
from islands.data.batches import BatchError
from islands.loop import (
    Callback,
    Checkpointing,
    Constant,
    Evaluate,
    Progress,
    RunRecord,
    SaveModel,
    Task,
    Trainer,
    WarmupCosine,
    evaluate,
)
from islands.runtime import simulate  # M islands in one process (islands.runtime.simulate)
from islands.runtime.comm import Comm, CommLedger
from islands.runtime.compiled import Compile
from islands.runtime.world import World, close_world, init_world
from islands.sync.base import NoOp, Strategy
from islands.sync.stack import Stack
from islands.version import __version__

__all__ = [
    "BatchError",
    "Callback",
    "Checkpointer",
    "Checkpointing",
    "Comm",
    "CommLedger",
    "Compile",
    "Constant",
    "Evaluate",
    "NoOp",
    "Progress",
    "RunRecord",
    "SaveModel",
    "Stack",
    "Strategy",
    "Task",
    "Trainer",
    "WarmupCosine",
    "World",
    "__version__",
    "close_world",
    "compress",
    "control",
    "evaluate",
    "init_world",
    "inner",
    "observe",
    "optim",
    "outer",
    "robust",
    "simulate",
]
