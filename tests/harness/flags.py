"""Command lines for tests that start islands' CLI: `flags(d_model=32, no_progress=True)` is
["--d-model", "32", "--no-progress"], so a test states the values it cares about, not a long list of strings."""

import sys

# `islands train` in a fresh interpreter of this one's
ISLANDS_TRAIN = [sys.executable, "-m", "islands", "train"]

# The byte LM at its smallest: what every CLI job of the tests trains unless it says otherwise.
TINY_MODEL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "context": 32, "global_batch": 4}


def flags(**values: object) -> list[str]:
    """One `--name value` pair per keyword (underscores become dashes); True gives the bare flag, False or None
    leaves the flag out."""
    out: list[str] = []
    for name, value in values.items():
        if value is None or value is False:
            continue
        out.append("--" + name.replace("_", "-"))
        if value is not True:
            out.append(str(value))
    return out


def tiny(**values: object) -> list[str]:
    """The tiny byte LM's flags, with `values` added or overriding them (None drops one)."""
    return flags(**{**TINY_MODEL, **values})
