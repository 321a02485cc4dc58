"""Models compiled with `torch.compile` under islands' strategies (docs/own-model.md, "Compiled models").

`torch.compile(module)` returns an OptimizedModule that holds the module as `_orig_mod`: the same Parameter and
buffer objects, but every state_dict key and parameter name gains an `_orig_mod.` prefix. islands keys what it keeps
by those names (checkpoints, the compressors' per-parameter state, FSDP's full copy), so a compiled run and an eager
run would write different keys for the same model. `uncompiled` is the module under any compile wrappers: the
strategies (islands.sync.ddp.unwrap), the checkpoints and the Trainer name and save parameters from it, so the
names, the checkpoints and the exported models are the same compiled or not.

`Compile` is what `Trainer(compile=...)` and `train.compile` apply: torch.compile's backend and mode, used on the
model the strategy returned (after wrap: DDP's graph is then split at its buckets, so the all-reduces still overlap
backward). Under FSDP2 it compiles each unit fully_shard made instead of the whole model (the strategy names them:
islands.sync.base.CompilesByUnit), as torchtitan compiles each block: FSDP2's hooks run between the compiled
regions, and a unit that is one of torch's own layers compiles too, which a whole-model compile leaves eager.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# torch.compile's modes (torch.compile's docstring); "default" passes None
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_SECONDS_DEFINITION = (
    "the first step's wall time minus the median of the other steps of the fit: the compilation of forward and "
    "backward, plus whatever else only the first step pays, which an eager run of the job pays too"
)


def is_compiled(module: torch.nn.Module) -> bool:
    """True for torch.compile's wrapper. Read from torch._dynamo only when it is loaded: importing it costs seconds,
    and nothing can have been compiled in a process that never loaded it."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def uncompiled(module: torch.nn.Module) -> torch.nn.Module:
    """The module under every torch.compile wrapper (the object itself when it is not compiled)."""
    while is_compiled(module):
        module = module._orig_mod  # type: ignore[assignment]  # OptimizedModule's own attribute
    return module


@dataclass(frozen=True)
class Compile:
    """torch.compile settings for the Trainer: `backend` ("inductor", or any of torch._dynamo.list_backends(
    exclude_tags=()): "aot_eager" traces forward and backward without generating code) and `mode` (MODES)."""

    backend: str = "inductor"
    mode: str = "default"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"Compile(mode={self.mode!r}): choose one of {', '.join(MODES)}")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"Compile(backend={self.backend!r}): name a torch.compile backend, e.g. 'inductor'")

    def apply(self, model: torch.nn.Module, units: Sequence[torch.nn.Module] = ()) -> torch.nn.Module:
        """The module to run forward and backward through: torch.compile's wrapper of `model`, or, given `units` (the
        modules a sharding strategy names, islands.sync.base.CompilesByUnit), `model` itself with each unit's
        `forward` compiled in place. Per unit whenever there are units, never as a fallback after a whole-model
        compile traced nothing: which graphs exist is then decided by the strategy before the first step, the same
        for every model, instead of by what the first step happened to trace."""
        mode = None if self.mode == "default" else self.mode
        if not units:
            compiled = torch.compile(model, backend=self.backend, mode=mode)
            assert isinstance(compiled, torch.nn.Module)  # a module compiles to a module (torch types it as a callable)
            return compiled
        for unit in units:
            # the forward, not the call (nn.Module.compile): the call runs FSDP's hooks, which torch does not trace, and
            # after that break it does not start again in a torch layer's forward (the digits MLP's nn.Linear units
            # compiled 0 graphs that way, 3 this way; torch 2.13). An instance attribute: names, state_dict keys and
            # hooks stay as they were. A deepcopy of the module would share it, so copies are taken before (eval_model)
            unit.forward = torch.compile(unit.forward, backend=self.backend, mode=mode)
        return model

    def record(self, step_seconds: list[float], graphs: int | None = None, units: int = 0) -> dict:
        """The run record's `compile` part, from the fit's step times (COMPILE_SECONDS_DEFINITION), the graphs torch
        compiled meanwhile (`graphs_compiled`; 0: the model ran eagerly, nothing was compiled) and the units compiled
        one by one (`apply`; 0: the whole model as one)."""
        rest = step_seconds[1:]
        steady = statistics.median(rest) if rest else 0.0
        first = step_seconds[0] if step_seconds else 0.0
        return {
            "backend": self.backend,
            "mode": self.mode,
            "seconds": max(first - steady, 0.0) if rest else None,
            "first_step_seconds": first,
            "steady_step_seconds": steady,
            "graphs": graphs,
            "units": units,
            "definition": COMPILE_SECONDS_DEFINITION,
        }


def graphs_compiled() -> int:
    """Graphs torch.compile has compiled in this process so far (its own counter; 0 before torch._dynamo loads).
    A compiled model whose fit adds none ran eagerly: under DDP, or under FSDP when the user compiled the whole model
    themselves, a model that is a bare torch container (nn.Sequential) compiled after wrap is one (docs/own-model.md,
    "Compiled models")."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


def check_backend(backend: str, device: str) -> None:
    """ValueError unless torch.compile can run `backend` on `device` ("cpu" or "cuda"): a backend torch knows, and
    for inductor on the CPU a C++ compiler (its kernels are C++ built at the first step, which would otherwise fail
    there, on every worker, with a compiler traceback)."""
    from torch._dynamo import list_backends

    known = list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"compile backend {backend!r} is not one torch knows; choose one of {', '.join(known)}")
    if backend == "inductor" and device == "cpu":
        cxx = [c for c in (os.environ.get("CXX", ""), "g++", "clang++", "c++") if c]
        if not any(shutil.which(c) for c in cxx):
            raise ValueError(
                "compile backend inductor builds C++ kernels on the CPU and no C++ compiler was found "
                f"(looked for {', '.join(cxx)}); install one (g++) or use compile_backend=aot_eager"
            )


def as_compile(value) -> Compile | None:
    """Trainer(compile=...): True (Compile()), a Compile, or False/None (eager)."""
    if value is None or value is False:
        return None
    if value is True:
        return Compile()
    if isinstance(value, Compile):
        return value
    raise TypeError(
        f"compile= takes True, False or islands.Compile(backend=..., mode=...); got {type(value).__name__} {value!r}"
    )
