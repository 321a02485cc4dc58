"""The model a run ends with: one directory, written whole or not at all.

    write_model_dir(RUN_DIR / "model", writer, model, info)   -> the file names written
    read_info(RUN_DIR / "model")                               -> what INFO_FILE says (step, format, ...)

`writer` is any ModelWriter: SafetensorsWriter here (model.safetensors of the model's state, shared tensors
once), or a task's own (a transformers model: its save_pretrained files and tokenizer, islands.tasks.hf_lm).
Every file goes into a hidden temporary sibling (`.model.tmp-<nonce>`), is fsynced, and the directory is renamed
into place; a directory already there (a run directory trained again) is renamed aside first and removed after.
A writer that raises leaves no temporary behind, and a process killed part-way leaves only a `.tmp-` sibling,
which the next write removes: a reader sees a finished model directory or none.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from islands.checkpoint.store.fsio import TMP_MARK, fsync_dir, nonce

MODEL_DIR = "model"  # RUN_DIR/model: the global model after the final synchronisation
INFO_FILE = "islands.json"  # beside the model's files: the step, the format, what the model is
WEIGHTS_FILE = "model.safetensors"


@runtime_checkable
class ModelWriter(Protocol):
    """Writes a model's files into an empty directory; `format` names what a reader loads them with."""

    format: str

    def write(self, model: torch.nn.Module, directory: Path) -> None: ...


class SafetensorsWriter:
    """model.safetensors: the model's state_dict (parameters and buffers). A tensor under two names (tied weights)
    is stored once, under the first (safetensors.torch.load_model puts it back under both); a tensor that is a view
    into a larger buffer (the pipeline's gathered stages) is copied out, since a file holds whole tensors only."""

    format = "safetensors"

    def write(self, model: torch.nn.Module, directory: Path) -> None:
        from safetensors.torch import save_file

        save_file(own_tensors(model.state_dict()), str(directory / WEIGHTS_FILE), metadata={"format": "pt"})


def own_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every tensor once (a second name of the same view left out) and each owning its storage."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for name, t in state.items():
        t = t.detach()
        view = (t.device, t.dtype, t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and view in seen:
            continue
        seen.add(view)
        whole = t.is_contiguous() and t.storage_offset() == 0
        whole = whole and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        out[name] = t if whole else t.clone(memory_format=torch.contiguous_format)
    return out


def write_model_dir(target: Path, writer: ModelWriter, model: torch.nn.Module, info: dict) -> list[str]:
    """Write `model` through `writer` to the directory `target`, and INFO_FILE ({"format": ..., **info}) beside
    it, atomically (module docstring). Returns the names of the files written, sorted."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_partials(target)
    tmp = target.with_name(f".{target.name}{TMP_MARK}{nonce()}")
    tmp.mkdir()
    try:
        writer.write(model, tmp)
        (tmp / INFO_FILE).write_text(json.dumps({"format": writer.format, **info}, indent=1))
        names = sorted(p.name for p in tmp.iterdir())
        for p in tmp.rglob("*"):
            if p.is_file():
                _fsync_file(p)
        fsync_dir(tmp)
        old = None
        if target.exists():
            old = target.with_name(f".{target.name}{TMP_MARK}old-{nonce()}")
            os.replace(target, old)
        os.replace(tmp, target)
        fsync_dir(target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return names


def remove_partials(target: Path) -> list[str]:
    """Delete what interrupted writes of `target` left (its hidden `.tmp-` siblings); returns their names."""
    gone = []
    for p in target.parent.glob(f".{target.name}{TMP_MARK}*"):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        gone.append(p.name)
    return sorted(gone)


def read_info(directory: Path) -> dict | None:
    """INFO_FILE of a model directory, or None when it has none (not written by write_model_dir)."""
    path = Path(directory) / INFO_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
