"""Public names kept for one release after a rename (docs/deprecations.md): the one table of deprecated aliases.

A public module lists none of these in `__all__`; it sets `__getattr__ = alias_getattr(__name__)`, so the old
name still resolves (attribute access and `from M import old`) with a DeprecationWarning naming the new home.
tests/test_public_homes.py checks that every other public name has exactly one home.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable

REMOVED_IN = "0.3.0"  # deprecated in 0.2.0: one release

# (module, old name) -> (module, new name)
ALIASES: dict[tuple[str, str], tuple[str, str]] = {
    # two names for one class in one module; CoordinateMedian says which median (GeometricMedian is one too)
    ("islands.robust", "Median"): ("islands.robust", "CoordinateMedian"),
    # collided with the islands.observe package (loggers); it reads a running job's membership store
    ("islands.control", "observe"): ("islands.control", "observe_job"),
}


def alias_getattr(module: str) -> Callable[[str], Any]:
    """The module-level `__getattr__` of `module`: its deprecated names, each with a warning; AttributeError else."""

    def __getattr__(name: str) -> Any:
        target = ALIASES.get((module, name))
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new_module, new_name = target
        warnings.warn(f"{module}.{name} is deprecated and will be removed in islands {REMOVED_IN}; use "
                      f"{new_module}.{new_name}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new_module), new_name)

    return __getattr__
