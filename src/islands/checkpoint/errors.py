"""Errors raised by islands.checkpoint: corruption and mismatch are different failures with different fixes."""

from __future__ import annotations


class CorruptCheckpoint(Exception):
    """Stored bytes fail a checksum or cannot be parsed: the data on disk (or in memory) is damaged."""


class CheckpointMismatch(ValueError):
    """The checkpoint is intact but was written by a different model or config.

    `differences` lists one human-readable line per difference (missing/unexpected keys, shapes,
    dtypes, fingerprint), so a caller can print exactly what to fix.
    """

    def __init__(self, differences: list[str]):
        self.differences = list(differences)
        shown = "\n  ".join(self.differences[:20])
        more = f"\n  ... and {len(self.differences) - 20} more" if len(self.differences) > 20 else ""
        super().__init__(f"checkpoint does not match the current model/config:\n  {shown}{more}")


class NoCheckpoint(FileNotFoundError):
    """No intact checkpoint exists where one was asked for."""
