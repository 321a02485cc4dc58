"""State trees: nested dicts/lists of tensors and plain values, split into a JSON skeleton plus tensors.

The trainer hands over trees like {"step": 120, "model": {...tensors...}, "optimizer": opt.state_dict(),
"rng": {...}}. Checkpoints never pickle (code execution on load), so a tree is written as a JSON skeleton
whose tensor leaves are replaced by names, and the tensors go through the codec. Things JSON cannot say
on its own (int dict keys as in optimizer state, tuples as in random.getstate(), bytes, numpy arrays)
are tagged explicitly, so `unflatten_tree(*flatten_tree(t))` gives back an equal tree with equal types.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping

import numpy as np
import torch

_TAGS = ("__tensor__", "__ndarray__", "__bytes__", "__tuple__", "__dict__")
_SCALARS = (type(None), bool, int, float, str)


def flatten_tree(tree) -> tuple[object, dict[str, torch.Tensor]]:
    """Split `tree` into (JSON-able skeleton, {name: tensor}). Tensors are not copied here."""
    tensors: dict[str, torch.Tensor] = {}

    def name_for(path: tuple) -> str:
        base = "/".join(str(k) for k in path) or "<root>"
        name, n = base, 1
        while name in tensors:  # keys like 1 and "1" render the same: keep both
            n += 1
            name = f"{base}#{n}"
        return name

    def walk(node, path: tuple):
        if isinstance(node, torch.Tensor):
            name = name_for(path)
            tensors[name] = node
            return {"__tensor__": name}
        if isinstance(node, np.ndarray):
            if node.dtype == object:
                raise TypeError(
                    f"state tree leaf at {'/'.join(map(str, path))!r} is an object array; "
                    "only numeric numpy arrays can be checkpointed"
                )
            name = name_for(path)
            tensors[name] = torch.from_numpy(np.ascontiguousarray(node))
            return {"__ndarray__": name}
        if isinstance(node, np.generic):
            return node.item()
        if isinstance(node, _SCALARS):
            return node
        if isinstance(node, (bytes, bytearray)):
            return {"__bytes__": base64.b64encode(bytes(node)).decode("ascii")}
        if isinstance(node, tuple):
            return {"__tuple__": [walk(v, path + (i,)) for i, v in enumerate(node)]}
        if isinstance(node, list):
            return [walk(v, path + (i,)) for i, v in enumerate(node)]
        if isinstance(node, Mapping):
            plain = all(isinstance(k, str) and not k.startswith("__") for k in node)
            if plain:
                return {k: walk(v, path + (k,)) for k, v in node.items()}
            for k in node:
                if not isinstance(k, _SCALARS):
                    raise TypeError(
                        f"state tree dict key {k!r} at {'/'.join(map(str, path))!r} is a "
                        f"{type(k).__name__}; keys must be str, int, float, bool or None"
                    )
            return {"__dict__": [[k, walk(v, path + (k,))] for k, v in node.items()]}
        raise TypeError(
            f"state tree leaf at {'/'.join(map(str, path)) or '<root>'!r} is a {type(node).__name__}; "
            "allowed: tensors, numpy arrays, None/bool/int/float/str, bytes, lists, tuples, dicts"
        )

    return walk(tree, ()), tensors


def unflatten_tree(skeleton, tensors: Mapping[str, torch.Tensor]):
    """Inverse of `flatten_tree`: rebuild the tree, taking tensors by name from `tensors`."""

    def walk(node):
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, dict):
            if len(node) == 1:
                ((tag, value),) = node.items()
                if tag == "__tensor__":
                    return tensors[value]
                if tag == "__ndarray__":
                    return tensors[value].numpy()
                if tag == "__bytes__":
                    return base64.b64decode(value)
                if tag == "__tuple__":
                    return tuple(walk(v) for v in value)
                if tag == "__dict__":
                    return {k: walk(v) for k, v in value}
            return {k: walk(v) for k, v in node.items()}
        return node

    return walk(skeleton)


def copy_tree(tree, reuse: dict[str, torch.Tensor] | None = None):
    """A private deep copy: every tensor cloned into contiguous CPU memory nobody else holds.

    This is the snapshot phase of two-phase checkpointing (LIT-059): after it returns, training may
    change the live tensors freely. `reuse` ({name: tensor} from `staging_buffers` of an earlier copy
    whose readers are done) supplies already-touched buffers of matching shape and dtype, so a repeat
    snapshot copies instead of faulting in fresh pages (or pinning new ones: see staging_block).
    """
    skeleton, tensors = flatten_tree(tree)
    pool: dict[str, torch.Tensor] = {}
    for name, old in (reuse or {}).items():  # keep only buffers that fit; the rest go before we allocate
        src = tensors.get(name)
        if (
            src is not None
            and old.shape == src.shape
            and old.dtype == src.dtype
            and (src.device.type != "cuda" or old.is_pinned())
        ):
            pool[name] = old
    reuse = None
    fresh = staging_block({n: t for n, t in tensors.items() if n not in pool})
    copies = {}
    from_gpu = False
    for name, t in tensors.items():
        src = t.detach()
        gpu = src.device.type == "cuda"
        buf = pool.pop(name, None)
        if buf is None:
            buf = fresh[name]
        # device -> pinned host copies run asynchronously on the current stream; one sync below
        copies[name] = buf.copy_(src, non_blocking=gpu)
        from_gpu |= gpu
    if from_gpu:
        torch.cuda.current_stream().synchronize()  # the snapshot is complete before anyone reads it
    return unflatten_tree(skeleton, copies)


_ALIGN = 256  # bytes: every view starts aligned for any dtype (and for vectorised copies)


def staging_block(tensors: Mapping[str, torch.Tensor], *, touch: bool = False) -> dict[str, torch.Tensor]:
    """Host buffers for `tensors`, as views into one allocation: pinned (page-locked) when any source
    lives on a CUDA device, so the copies are DMAs that need no bounce buffer and run asynchronously;
    ordinary memory otherwise (pinning gains a CPU-to-CPU copy nothing). One block, not one per tensor:
    each page-locking call costs far more than its bytes' copy, and torch's pinned allocator rounds every
    request up to a power of two. `touch` writes every page once, so a copy into the block later finds
    them mapped (AsyncCheckpointer.reserve)."""
    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    total = sum(-(-b // _ALIGN) * _ALIGN for b in sizes.values())
    pin = torch.cuda.is_available() and any(t.device.type == "cuda" for t in tensors.values())
    block = torch.empty(total, dtype=torch.uint8, device="cpu", pin_memory=pin)
    if touch:
        block.zero_()
    views, offset = {}, 0
    for name, t in tensors.items():
        views[name] = block[offset : offset + sizes[name]].view(t.dtype).view(t.shape)
        offset += -(-sizes[name] // _ALIGN) * _ALIGN
    return views


def staging_tensor(src: torch.Tensor) -> torch.Tensor:
    """A host buffer for one tensor (see staging_block)."""
    return staging_block({"x": src})["x"]


def staging_buffers(tree) -> dict[str, torch.Tensor]:
    """{name: tensor} of a snapshot made by copy_tree, for `copy_tree(..., reuse=...)`."""
    return flatten_tree(tree)[1]


def tree_nbytes(tree) -> int:
    """Bytes of tensor data in the tree (what a snapshot copies)."""
    _, tensors = flatten_tree(tree)
    return sum(t.numel() * t.element_size() for t in tensors.values())
