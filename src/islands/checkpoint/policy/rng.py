"""The random number generators a training step draws from, as checkpointable state.

torch's CPU generator (dropout on CPU, random init, torch.randint without a generator), the CUDA
generator of the current device when CUDA is in use (dropout on the GPU), python's `random` and
numpy's global generator. Generators a program makes itself (torch.Generator, numpy's default_rng)
are its own to save, e.g. through `extra=` of the Checkpointer.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    """The state of every global generator; "cuda" only when CUDA is initialised in this process
    (a process that never touched CUDA has drawn nothing from it)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Put back what rng_state() returned. A "cuda" entry is set on the current device when CUDA exists
    here (a checkpoint made on a GPU machine still loads on a CPU one, without it)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
