"""Checkpoint fingerprints: an opaque string stored in every checkpoint and compared on load.

Whoever builds the job decides what defines "the same model" and makes the string; the checkpoint
code only stores and compares it. `fingerprint_of(fields)` is the usual form: canonical JSON of a
dict of model-defining fields, so a mismatch can be reported field by field.
"""

from __future__ import annotations

import json


def fingerprint_of(fields: dict) -> str:
    """Canonical JSON of `fields` (e.g. {"d_model": 64, "n_layers": 2}): equal dicts give equal strings."""
    if not isinstance(fields, dict):
        raise TypeError(f"fingerprint_of takes a dict of model-defining fields; got {type(fields).__name__}")
    return json.dumps(fields, sort_keys=True)


def _fields(fp: str | None) -> dict:
    try:
        out = json.loads(fp) if fp else {}
    except ValueError:
        return {"<fingerprint>": fp}
    return out if isinstance(out, dict) else {"<fingerprint>": fp}


def fingerprint_differences(stored: str | None, current: str | None) -> list[str]:
    """Field by field, 'd_model: checkpoint 64, current 128'; a string that is not a JSON dict compares whole."""
    if (stored or "") == (current or ""):
        return []
    a, b = _fields(stored), _fields(current)
    diffs = [
        f"{k}: checkpoint {a.get(k, '<absent>')!r}, current {b.get(k, '<absent>')!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]
    return diffs or [f"fingerprint: checkpoint {stored!r}, current {current!r}"]
