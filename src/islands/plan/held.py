"""Bytes of tensors a run actually holds: every tensor reachable from the given objects (a model, its optimizer, the
strategy), each storage counted once. What memory predictions are checked against on a CPU, where the allocator
keeps no peak (on CUDA, torch.cuda.max_memory_allocated is the measure); with the saved-for-backward peak
(islands.memory.SavedTensorMeter) it is the step's peak of tensor bytes."""

from __future__ import annotations

import torch


def held_bytes(*roots, exclude=()) -> int:
    """Sum of the distinct storages of tensors reachable from `roots` through attributes, dicts, lists, tuples and
    sets (modules and optimizers included); storages of tensors reachable from `exclude` are left out."""
    skip = {_key(t) for t in _tensors(exclude)}
    sizes = {}
    for t in _tensors(roots):
        k = _key(t)
        if k not in skip:
            sizes[k] = t.untyped_storage().nbytes()
    return sum(sizes.values())


def _key(t: torch.Tensor) -> tuple:
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


def _tensors(roots):
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.untyped_storage().nbytes():
                yield obj
            if obj.grad is not None:
                stack.append(obj.grad)
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and (
            isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))  # a user's or transformers' module too
            or type(obj).__module__.split(".")[0] in ("islands", "torch", "__main__")
        ):
            stack.extend(vars(obj).values())
        elif hasattr(obj, "__slots__"):
            stack.extend(getattr(obj, s, None) for s in obj.__slots__ if isinstance(s, str))
