"""Public names kept for one release after a rename (docs/deprecations.md): the one table of deprecated aliases.

A public module lists none of these in `__all__`; it sets `__getattr__ = alias_getattr(__name__)`, so the old
name still resolves (attribute access and `from M import old`) with a DeprecationWarning naming the new home.
tests/unit/project/test_public_homes.py checks that every other public name has exactly one home.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

REMOVED_IN = "0.3.0"  # deprecated in 0.2.0: one release

# (module, old name) -> (module, new name)
ALIASES: dict[tuple[str, str], tuple[str, str]] = {
    # two names for one class in one module; CoordinateMedian says which median (GeometricMedian is one too)
    ("islands.robust", "Median"): ("islands.robust", "CoordinateMedian"),
    # collided with the islands.observe package (loggers); it reads a running job's membership store
    ("islands.control", "observe"): ("islands.control", "observe_job"),
    # islands.checkpoint keeps a small public face (issue #33 item 2); the rest moved to the sub-package it belongs to:
    # codec (the tensor codec), store (where bytes go, how they survive), policy (when and what to save)
    ("islands.checkpoint", "TensorCodec"): ("islands.checkpoint.codec", "TensorCodec"),
    ("islands.checkpoint", "content_hash"): ("islands.checkpoint.codec", "content_hash"),
    ("islands.checkpoint", "decode_tensor"): ("islands.checkpoint.codec", "decode_tensor"),
    ("islands.checkpoint", "encode_tensor"): ("islands.checkpoint.codec", "encode_tensor"),
    ("islands.checkpoint", "tensor_bytes"): ("islands.checkpoint.codec", "tensor_bytes"),
    ("islands.checkpoint", "AsyncCheckpointer"): ("islands.checkpoint.store", "AsyncCheckpointer"),
    ("islands.checkpoint", "SaveHandle"): ("islands.checkpoint.store", "SaveHandle"),
    ("islands.checkpoint", "LoadedCheckpoint"): ("islands.checkpoint.store", "LoadedCheckpoint"),
    ("islands.checkpoint", "SaveResult"): ("islands.checkpoint.store", "SaveResult"),
    ("islands.checkpoint", "DiskLevel"): ("islands.checkpoint.store", "DiskLevel"),
    ("islands.checkpoint", "MemoryLevel"): ("islands.checkpoint.store", "MemoryLevel"),
    ("islands.checkpoint", "MultiLevelCheckpointer"): ("islands.checkpoint.store", "MultiLevelCheckpointer"),
    ("islands.checkpoint", "Restored"): ("islands.checkpoint.store", "Restored"),
    ("islands.checkpoint", "pack_tree"): ("islands.checkpoint.store", "pack_tree"),
    ("islands.checkpoint", "unpack_tree"): ("islands.checkpoint.store", "unpack_tree"),
    ("islands.checkpoint", "copy_tree"): ("islands.checkpoint.store", "copy_tree"),
    ("islands.checkpoint", "flatten_tree"): ("islands.checkpoint.store", "flatten_tree"),
    ("islands.checkpoint", "unflatten_tree"): ("islands.checkpoint.store", "unflatten_tree"),
    ("islands.checkpoint", "tree_nbytes"): ("islands.checkpoint.store", "tree_nbytes"),
    ("islands.checkpoint", "CheckpointDriver"): ("islands.checkpoint.policy", "CheckpointDriver"),
    ("islands.checkpoint", "TrainingState"): ("islands.checkpoint.policy", "TrainingState"),
    ("islands.checkpoint", "parse_policy"): ("islands.checkpoint.policy", "parse_policy"),
    ("islands.checkpoint", "CheckFreqPolicy"): ("islands.checkpoint.policy", "CheckFreqPolicy"),
    ("islands.checkpoint", "CombinedIntervalPolicy"): ("islands.checkpoint.policy", "CombinedIntervalPolicy"),
    ("islands.checkpoint", "IntervalDecision"): ("islands.checkpoint.policy", "IntervalDecision"),
    ("islands.checkpoint", "YoungDalyInterval"): ("islands.checkpoint.policy", "YoungDalyInterval"),
    ("islands.checkpoint", "checkfreq_interval"): ("islands.checkpoint.policy", "checkfreq_interval"),
    ("islands.checkpoint", "expected_waste_fraction"): ("islands.checkpoint.policy", "expected_waste_fraction"),
    ("islands.checkpoint", "young_daly_seconds"): ("islands.checkpoint.policy", "young_daly_seconds"),
    ("islands.checkpoint", "DEFAULT_DEVICE_MTBF_DAYS"): ("islands.checkpoint.policy", "DEFAULT_DEVICE_MTBF_DAYS"),
    ("islands.checkpoint", "SimulationResult"): ("islands.checkpoint.policy", "SimulationResult"),
    ("islands.checkpoint", "simulate_failures"): ("islands.checkpoint.policy", "simulate_failures"),
}


def alias_getattr(module: str) -> Callable[[str], Any]:
    """The module-level `__getattr__` of `module`: its deprecated names, each with a warning; AttributeError else."""

    def __getattr__(name: str) -> Any:
        target = ALIASES.get((module, name))
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new_module, new_name = target
        warnings.warn(
            f"{module}.{name} is deprecated and will be removed in islands {REMOVED_IN}; use {new_module}.{new_name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new_module), new_name)

    return __getattr__
