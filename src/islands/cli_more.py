"""Subcommands whose libraries live in their own packages: testbed, ckpt (and join, with membership)."""

from __future__ import annotations

import argparse


class UsageError(Exception):
    """Raised by subcommands for bad input; the CLI prints it and exits 2."""


def _testbed(args) -> int:
    from islands.testbed import cli as tcli

    try:
        if args.action == "up":
            tcli.cmd_up(args.hosts, args.rate, name=args.name, subnet=args.subnet, measure_seconds=args.measure)
        elif args.action == "down":
            tcli.cmd_down(None if args.all else args.name, all_testbeds=args.all)
        else:
            tcli.cmd_status()
    except (ValueError, TypeError, PermissionError) as e:
        raise UsageError(str(e)) from None
    return 0


def add_more_commands(sub: argparse._SubParsersAction) -> None:
    tb = sub.add_parser("testbed", help="real rate-limited links: hosts as network namespaces (root)",
                        description="Create, inspect and remove a network testbed; `islands train --testbed NAME` "
                                    "then runs each worker inside one of its hosts.")
    tsub = tb.add_subparsers(dest="action", required=True)
    up = tsub.add_parser("up", help="create N hosts behind a bridge, every link shaped to RATE")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--rate", default="100mbit", help="e.g. 500kbit, 100mbit, 1gbit")
    up.add_argument("--name", default="default")
    up.add_argument("--subnet", default=None, help="10.77.K.0/24 style; default: first free")
    up.add_argument("--measure", type=float, default=2.0, help="seconds of TCP rate measurement (0 = skip)")
    down = tsub.add_parser("down", help="remove a testbed (idempotent)")
    down.add_argument("name", nargs="?", default="default")
    down.add_argument("--all", action="store_true", help="remove every islands testbed on this machine")
    tsub.add_parser("status", help="list testbeds and their measured rates")
    tb.set_defaults(fn=_testbed)
    from islands.checkpoint.cli import add_ckpt_command

    add_ckpt_command(sub, UsageError)  # islands ckpt ls|verify|inspect|diff|compress|decompress
