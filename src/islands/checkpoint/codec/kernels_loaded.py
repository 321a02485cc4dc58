"""Importing this module loads the codec's compiled loops (kernels.py) into the process, compiling whichever are not
in numba's on-disk cache yet (tensor.warm_kernels).

The fork server imports it (islands.runtime.launch.spawn.PRELOAD), so every worker forked from it has the loops
already: loading them from the cache cost each checkpointing process ~1.5 CPU-s at its first save or load (py-spy,
session 33: 15 of an elastic checkpoint test's ~45 CPU-s), and a checkout without the cache compiled them in every
process at once. Should loading fail, the server goes on without them (each worker then loads them as before)."""

from __future__ import annotations

import sys

from numba.core.errors import NumbaError  # without numba this import fails, and the fork server skips the module

from islands.checkpoint.codec.tensor import warm_kernels

try:
    warm_kernels()
except (NumbaError, OSError, RuntimeError) as e:  # an optimisation only: a worker then loads the loops itself
    print(f"islands: the codec's compiled loops were not preloaded ({type(e).__name__}: {e})", file=sys.stderr)
