"""Measurement built into every run: the interconnect probe, progress, and the run record."""

from islands.measure.probe import describe, probe_interconnect
from islands.measure.record import BASELINE_PER_WORKER, finish_record, versions, write_json_atomic
from islands.measure.timing import best_seconds

__all__ = [
    "BASELINE_PER_WORKER",
    "best_seconds",
    "describe",
    "finish_record",
    "probe_interconnect",
    "versions",
    "write_json_atomic",
]
