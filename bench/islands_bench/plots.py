"""The one way experiments draw: an off-screen matplotlib figure, saved and closed on exit."""

from __future__ import annotations

import contextlib
from pathlib import Path


@contextlib.contextmanager
def figure(path: str | Path, *grid, **subplots_kw):
    """`with figure(path, 1, 2, figsize=(10, 4)) as (fig, axes):` draws, then writes `path` (110 dpi)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers or in CI
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*grid, **subplots_kw)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
