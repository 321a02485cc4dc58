"""Tasks: the built-in `lm` and `digits`, `hf-causal-lm` (a transformers causal LM; islands.tasks.hf_lm), and a
user's `module:function` (islands.tasks.user)."""

from islands.tasks.builtin import Sharded, digits_task, lm_task
from islands.tasks.hf_lm import HFTask, hf_causal_lm
from islands.tasks.user import TaskError, build_user_task, is_user_task, load_factory

__all__ = [
    "HFTask",
    "Sharded",
    "TaskError",
    "build_user_task",
    "digits_task",
    "hf_causal_lm",
    "heavy_imports",
    "is_user_task",
    "lm_task",
    "load_factory",
]

# What a built-in task's workers import when they build it, each a second or more of interpreter time: a
# launcher's fork server imports them once (islands.runtime.launch.spawn.preload). transformers loads lazily: its
# model base and auto classes (~2.7 s of CPU on a 2-core machine) are what a worker's from_config reaches for;
# `import transformers` alone is ~0.7 s of it. digits needs none: its data is read without sklearn (data.corpus)
_HEAVY = {"hf-causal-lm": ("transformers.modeling_utils", "transformers.models.auto.modeling_auto")}


def heavy_imports(task: str) -> tuple[str, ...]:
    """The modules the workers of built-in task `task` import to build it (none for the others)."""
    return _HEAVY.get(task, ())
