"""Measurement built into every run: the interconnect probe, progress, and the run record."""
