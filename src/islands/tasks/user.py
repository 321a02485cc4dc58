"""A user's task by path: `my.module:make_task` (or `path/to/file.py:make_task`), where `make_task(config)`
returns an islands.Task. Every failure says what was given and what would work (the CLI exits 2)."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from islands.loop.task import Task


class TaskError(ValueError):
    """A user task that cannot be loaded or built; the message names the path and the problem."""


def is_user_task(name: str) -> bool:
    return ":" in name


def load_factory(path: str) -> Callable[[Any], Task]:
    """The function `path` names; TaskError if the module does not import or has no such callable."""
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise TaskError(
            f"task {path!r}: write module:function, e.g. my_project.tasks:make_task or path/to/file.py:make_task"
        )
    try:
        if module_name.endswith(".py"):
            file = Path(module_name)
            if not file.is_file():
                raise TaskError(f"task {path!r}: no file {str(file)!r}")
            spec = importlib.util.spec_from_file_location(file.stem, file)
            assert spec is not None and spec.loader is not None  # a .py file always gets a source loader
            module = importlib.util.module_from_spec(spec)
            sys.modules.setdefault(file.stem, module)
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path:  # `islands train` run from a project directory finds its modules there
                sys.path.insert(0, "")
            module = importlib.import_module(module_name)
    except TaskError:
        raise
    except Exception as e:  # any import failure is the user's module: say which and why
        raise TaskError(f"task {path!r}: module {module_name!r} does not import: {type(e).__name__}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        near = difflib.get_close_matches(attr, names, n=3)
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise TaskError(f"task {path!r}: module {module_name!r} has no {attr!r}{hint}")
    if not callable(fn):
        raise TaskError(f"task {path!r}: {attr!r} is a {type(fn).__name__}, not a function make_task(config)")
    return fn


def build_user_task(path: str, config: Any) -> Task:
    """Call the user's make_task(config); TaskError when it raises or returns something other than a Task."""
    fn = load_factory(path)
    try:
        task = fn(config)
    except Exception as e:  # the user's factory failed: report it as their input, not our crash
        raise TaskError(f"task {path!r}: make_task raised {type(e).__name__}: {e}") from e
    if not isinstance(task, Task):
        raise TaskError(
            f"task {path!r}: make_task returned a {type(task).__name__}; it must return "
            f"islands.Task(model, loss_fn, train_data, val_data)"
        )
    return task
