"""The `islands` command. Each subcommand is a thin shell over a library function.

Config errors exit 2 before any worker starts; a failed job exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

from rich.console import Console

from islands import practices as P
from islands.app.launch import launch
from islands.app.validate import validate
from islands.app.worker import run_worker
from islands.cli_cross import add_cross_store_command
from islands.cli_export import add_export_command
from islands.cli_more import UsageError, add_more_commands
from islands.cli_plan import add_plan_command
from islands.cli_ps import add_ps_host_command
from islands.cli_run import add_run_command
from islands.config import FLAT, ConfigError, JobConfig, default_text, descriptions, from_mapping, keys, load_toml
from islands.dashboard.cli import add_dashboard_command, add_train_flags, train_dashboard
from islands.report import add_report_command
from islands.runtime.launch.ranks import LaunchError
from islands.tasks.user import TaskError


class ExitError(Exception):
    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file of config tables ([train] steps = 300; flags override it)")
    text = descriptions()
    aliases: dict[str, list[str]] = {}
    for flat, dotted in FLAT.items():
        aliases.setdefault(dotted, []).append(flat)
    for dotted, typ in keys().items():
        if typ == "dict":
            continue
        flags = ["--" + dotted] + ["--" + a.replace("_", "-") for a in aliases.get(dotted, [])]
        # the key's one description (islands.config), its default; argparse reads % as a format: escape it
        help_text = f"{text[dotted]} (default {default_text(dotted)})".replace("%", "%%")
        if typ == "bool":
            p.add_argument(*flags, dest=dotted, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            kind = {"int": int, "float": float, "str": str, "spec": str}[typ]
            p.add_argument(*flags, dest=dotted, type=kind, default=None, metavar=typ.upper(), help=help_text)


def unvalidated_config(args: argparse.Namespace) -> JobConfig:
    """The job the flags and --config describe, before validation (islands plan validates per strategy)."""
    values = load_toml(args.config) if args.config else {}
    cfg = from_mapping(values)
    overrides = {k: getattr(args, k) for k in keys() if getattr(args, k, None) is not None}
    return from_mapping(overrides, base=cfg)


def config_from_args(args: argparse.Namespace) -> JobConfig:
    return validate(unvalidated_config(args))


def cmd_train(args) -> int:
    cfg = config_from_args(args)
    name = cfg.task.name.rpartition(":")[2] or cfg.task.name
    run_dir = Path(cfg.output.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{name}-w{cfg.world.workers}")
    if "RANK" in os.environ:  # started by torchrun: this process is one worker
        if args.dashboard is not None:
            raise ExitError(
                "--dashboard is served by islands' own launcher; under torchrun, run "
                f"`islands dashboard {run_dir}` beside the job instead"
            )
        run_worker(cfg, run_dir)
        return 0
    with train_dashboard(args, run_dir, ExitError):  # --dashboard: served from here while the job runs
        if cfg.world.workers == 1 and not cfg.world.testbed and not cfg.elastic.enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            run_worker(cfg, run_dir)
            return 0
        try:
            return launch(cfg, run_dir)
        except LaunchError as e:
            raise ExitError(str(e)) from None


def cmd_practices(args) -> int:
    console = Console()
    if args.papers:
        console.print(P.papers_table(P.load_papers()))
        return 0
    try:
        items = P.filter_practices(P.load_practices(), status=args.status, implemented=args.implemented)
    except ValueError as e:
        raise ExitError(str(e)) from None
    detail = args.detail or (args.status or "").lower() == "rejected"  # a rejection is its reason
    console.print(P.practices_table(items, detail=detail))
    return 0


def _bench_not_installed(args) -> int:
    raise ExitError(
        "`islands bench` comes with the benchmark suite, a separate package: "
        "pip install -e bench/ (from a checkout of islands)"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="islands",
        description=("Train PyTorch models across poorly connected, unreliable islands of devices, and measure it."),
    )
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser(
        "train",
        help="train a model with local workers (or one torchrun worker)",
        description="Train. Every config key is a flag (--section.key, or today's flat name); "
        "--config FILE.toml supplies defaults.",
    )
    _add_config_flags(t)
    add_train_flags(t)
    t.set_defaults(fn=cmd_train)

    pr = sub.add_parser("practices", help="the practice registry: what islands implements and measures")
    pr.add_argument("--status", help="Active, Proposed, Rejected or Open (any case)")
    g = pr.add_mutually_exclusive_group()
    g.add_argument("--implemented", dest="implemented", action="store_true", default=None)
    g.add_argument("--not-implemented", dest="implemented", action="store_false")
    pr.add_argument("--papers", action="store_true", help="show the reading list instead")
    pr.add_argument("--detail", action="store_true", help="add each claim (or rejection reason) and its sources")
    pr.set_defaults(fn=cmd_practices)

    add_more_commands(sub)
    add_ps_host_command(sub)
    add_cross_store_command(sub)
    add_run_command(sub)
    add_dashboard_command(sub, ExitError)
    add_report_command(sub)
    add_export_command(sub)
    add_plan_command(sub, _add_config_flags, unvalidated_config, ExitError)
    # Other distributions add subcommands (islands-bench adds `bench`); islands never imports them.
    for entry in entry_points(group="islands.commands"):
        entry.load()(sub)
    if "bench" not in sub.choices:
        # A stub that says where `bench` comes from; prefix_chars no option can start with, so that
        # `islands bench --list` reaches the hint instead of an "unrecognized arguments" error.
        stub = sub.add_parser(
            "bench", help="the benchmarks (not installed: pip install -e bench/)", add_help=False, prefix_chars="\0"
        )
        stub.add_argument("ignored", nargs="*")
        stub.set_defaults(fn=_bench_not_installed)
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.fn(args)
    except (ConfigError, ExitError, UsageError, TaskError) as e:
        print(f"islands: error: {e}", file=sys.stderr)
        code = getattr(e, "code", 2)
    sys.exit(code)
