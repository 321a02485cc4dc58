"""The parameter-server scripts' tier options: the bench's quick tier (the digits MLP) unless told otherwise, e.g. the
byte LM at a size of its own (`--task lm --ddp-steps 150 --h 25 --floor 0.4`: the bench's full tier since session 42;
DDP 1000 steps at H=100 padded to 250 ms, the full tier before, would take hours on this host)."""

from __future__ import annotations

import argparse


def add_tier_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", choices=("digits", "lm"), help="the task (default: the quick tier's digits)")
    parser.add_argument("--ddp-steps", type=int, help="DDP's steps; the arms train parameter_server.LONGER times more")
    parser.add_argument("--h", type=int, help="inner steps per round (and the evaluation interval)")
    parser.add_argument("--floor", type=float, help="seconds every step is padded to (the slow islands' times it)")
    parser.add_argument("--log-every", type=int, help="steps between logged points")


def tier_overrides(args: argparse.Namespace) -> dict:
    """The options given, as keys of parameter_server.tier()'s dict."""
    given = {"task": args.task, "ddp_steps": args.ddp_steps, "h": args.h, "floor": args.floor}
    given["log_every"] = args.log_every
    return {k: v for k, v in given.items() if v is not None}
