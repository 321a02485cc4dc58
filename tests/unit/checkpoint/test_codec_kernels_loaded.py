"""The codec's compiled loops are loaded by an import (islands.checkpoint.codec.kernels_loaded), which the fork server
makes, so that forked workers inherit them instead of each loading them at its first checkpoint."""

from __future__ import annotations

import numba

import islands.checkpoint.codec.kernels as kernels
from islands.runtime.launch import spawn


def test_importing_kernels_loaded_leaves_every_loop_of_the_codec_compiled():
    import islands.checkpoint.codec.kernels_loaded  # noqa: F401

    loops = {n: f for n, f in vars(kernels).items() if isinstance(f, numba.core.registry.CPUDispatcher)}
    public = {n for n in loops if not n.startswith("_")}  # the loops layouts.py calls; the _helpers inline into them
    assert {"split_fp32", "join_fp32", "split_bf16", "patch_escapes"} <= public
    not_compiled = sorted(n for n in public if not loops[n].signatures)
    assert not not_compiled, f"loops the warm-up did not compile: {not_compiled}"


def test_the_fork_server_preloads_it():
    assert "islands.checkpoint.codec.kernels_loaded" in spawn.PRELOAD
