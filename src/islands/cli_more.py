"""Subcommands whose libraries live in their own packages: testbed, ckpt, join."""

from __future__ import annotations

import argparse


def add_more_commands(sub: argparse._SubParsersAction) -> None:
    """Filled in as the testbed, checkpoint and membership packages land."""
