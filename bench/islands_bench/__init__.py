"""Experiments: one per registry claim, each writing JSON, a plot and a markdown summary."""
