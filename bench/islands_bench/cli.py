"""`islands bench`: contributed to islands' CLI through the `islands.commands` entry-point group.

islands never imports the bench; its parser calls `add_command(subparsers)` for every installed entry.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path


def add_command(subparsers) -> argparse.ArgumentParser:
    b = subparsers.add_parser("bench", help="run a registered experiment and write results/NAME/")
    b.add_argument("name", nargs="?", help="experiment name (see --list)")
    b.add_argument("--list", action="store_true", help="list experiments and the practices they test")
    b.add_argument("--quick", action="store_true", help="smaller, faster version of the experiment")
    b.add_argument(
        "--smoke",
        action="store_true",
        help="the quick version cut to a few steps and the smallest sizes: checks that it runs end to "
        "end, its numbers mean nothing (results/NAME/smoke/)",
    )
    b.add_argument("--out", default="results", help="results root (default results/)")
    b.add_argument(
        "--testbed-rate", metavar="RATE", help="run distributed configurations on a testbed at RATE, e.g. 100mbit"
    )
    b.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the experiment's tensors live (cuda: only experiments with a GPU variant)",
    )
    b.add_argument(
        "--reuse",
        action="store_true",
        help="read a run whose results/NAME/.../runs/LABEL/run.json holds the same config instead of running "
        "it again (resume an interrupted experiment; testbed runs always run)",
    )
    b.set_defaults(fn=cmd_bench)
    return b


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def cmd_bench(args) -> int:
    from islands_bench import harness

    if args.list or not args.name:
        harness.print_list()
        return 0
    # SIGTERM (a `kill`, a CI timeout) unwinds like Ctrl-C: experiments' finally blocks stop their jobs, etcd
    # clusters and testbeds instead of leaving them running
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        harness.run(
            args.name,
            quick=args.quick,
            out_root=Path(args.out),
            rate=args.testbed_rate or "",
            device=args.device,
            reuse=args.reuse,
            smoke=args.smoke,
        )
    except KeyError as e:  # an unknown experiment: the message lists the known ones
        print(f"islands: error: {e.args[0]}", file=sys.stderr)
        return 2
    return 0
