"""Tasks: the built-in `lm` and `digits`, and a user's `module:function` (islands.tasks.user)."""

from islands.tasks.builtin import Sharded, digits_task, lm_task
from islands.tasks.user import TaskError, build_user_task, is_user_task, load_factory

__all__ = ["Sharded", "TaskError", "build_user_task", "digits_task", "is_user_task", "lm_task", "load_factory"]
