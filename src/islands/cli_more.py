"""Subcommands whose libraries live in their own packages: testbed, ckpt (and join, with membership)."""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

from islands.app.elastic_worker import exit_now, parse_address, run_elastic_worker
from islands.checkpoint.cli import add_ckpt_command
from islands.runtime.elastic import Excluded, JobEnded
from islands.runtime.membership import JOB_ENDED_EXIT_CODE, REFUSED_EXIT_CODE, Refused
from islands.testbed import cli as tcli


class UsageError(Exception):
    """Raised by subcommands for bad input; the CLI prints it and exits 2."""


def _testbed(args) -> int:
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


def _join(args) -> int:
    """islands join HOST:PORT: one elastic worker entering a running job (islands.app.elastic_worker)."""
    try:
        parse_address(args.address)
    except ValueError as e:
        raise UsageError(str(e)) from None
    token = args.token or os.environ.get("ISLANDS_TOKEN", "")
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as e:
            raise UsageError(f"cannot read --token-file {args.token_file!r}: {e.strerror}") from None
    if not token:
        raise UsageError("a token is required: --token T, --token-file PATH or ISLANDS_TOKEN in the environment")
    name = args.name or f"j{secrets.token_hex(4)}"
    run_dir = Path(args.run_dir or f"runs/join-{name}")
    try:
        run_elastic_worker(args.address, run_dir, name, token)
    except Refused as e:
        print(f"islands: join refused by {args.address}: {e}", flush=True)
        return REFUSED_EXIT_CODE
    except Excluded as e:
        print(f"islands: {e}", flush=True)
        return 1
    except JobEnded as e:
        print(f"islands: {args.address}: {e}", flush=True)
        return JOB_ENDED_EXIT_CODE
    exit_now(0)  # a retired gloo group could hold a normal exit until its timeout


def add_more_commands(sub: argparse._SubParsersAction) -> None:
    jn = sub.add_parser("join", help="join a running elastic job (started with islands train --elastic)",
                        description="Start one worker that asks the job at HOST:PORT to admit it, receives the "
                                    "current global model and outer-optimizer state at the next round, and trains "
                                    "from the round after. The job's config comes from the job itself.")
    jn.add_argument("address", help="HOST:PORT of the elastic job's store (printed by its launcher)")
    jn.add_argument("--token", default="", help="the job's secret (prefer --token-file or ISLANDS_TOKEN: "
                                                "arguments are visible to other users of this machine)")
    jn.add_argument("--token-file", default="", help="file holding the token (the launcher writes RUN_DIR/token)")
    jn.add_argument("--name", default="", help="this worker's name in the job (default: random)")
    jn.add_argument("--run-dir", default="", help="where this worker writes its records (default runs/join-NAME)")
    jn.set_defaults(fn=_join)
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

    add_ckpt_command(sub, UsageError)  # islands ckpt ls|verify|inspect|diff|compress|decompress
