"""`islands dashboard RUN_DIR` and the `--dashboard [PORT]` flag of `islands train` (its launcher serves it)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from islands.dashboard.server import DEFAULT_PORT, DashboardError, DashboardServer

DEFAULT_HOST = "127.0.0.1"


def _exposed_warning(server: DashboardServer, out) -> None:
    if not server.loopback:
        print(
            f"islands: warning: the dashboard listens on {server.host}, not on loopback: anyone who can reach "
            f"this machine on port {server.port} can read this run's config and numbers (read-only, no "
            f"authentication)",
            file=out,
            flush=True,
        )


def cmd_dashboard(args: argparse.Namespace, usage_error: type[Exception]) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        what = "is a file, not a run directory" if run_dir.exists() else "does not exist"
        raise usage_error(
            f"run directory {args.run_dir!r} {what}; give the --run-dir of a run "
            f"(islands train prints it), e.g. islands dashboard runs/<time>-lm-w2"
        )
    try:
        server = DashboardServer(run_dir, host=args.host, port=args.port, flag="--port")
        server.bind()
    except DashboardError as e:
        raise usage_error(str(e)) from None
    _exposed_warning(server, sys.stderr)
    print(f"islands: dashboard of {run_dir} at {server.url} (read-only; Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("islands: dashboard stopped", flush=True)
    return 0


def add_dashboard_command(sub: argparse._SubParsersAction, usage_error: type[Exception]) -> None:
    """`islands dashboard RUN_DIR`; bad input raises `usage_error` (exit 2)."""
    d = sub.add_parser(
        "dashboard",
        help="a live, read-only page of a running or finished run (127.0.0.1)",
        description="Serve a page of RUN_DIR until Ctrl-C: validation loss against steps and MB sent, "
        "membership per island, compute utilisation, link rates, checkpoints. It reads "
        "RUN_DIR/live/*.jsonl, run.json and elastic/*.json and updates every 2 s. "
        "Read-only; bound to 127.0.0.1 unless --host says otherwise (docs/dashboard.md).",
    )
    d.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (islands train's --run-dir)")
    d.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        metavar="P",
        help=f"port to serve on (default {DEFAULT_PORT}; 0 picks a free one)",
    )
    d.add_argument(
        "--host",
        default=DEFAULT_HOST,
        metavar="H",
        help="address to bind (default 127.0.0.1; anything else is reachable from other machines)",
    )
    d.set_defaults(fn=lambda args: cmd_dashboard(args, usage_error))


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """`--dashboard [PORT]` and `--dashboard-host` for `islands train`: launcher options, not job config."""
    parser.add_argument(
        "--dashboard",
        nargs="?",
        const=DEFAULT_PORT,
        type=int,
        default=None,
        metavar="PORT",
        help=f"serve a live dashboard of the run while it goes (default port {DEFAULT_PORT}; 0 picks "
        f"a free one); the launcher serves it, the workers are unchanged (docs/dashboard.md)",
    )
    parser.add_argument(
        "--dashboard-host", default=None, metavar="HOST", help="address the dashboard binds (default 127.0.0.1)"
    )


@contextmanager
def train_dashboard(
    args: argparse.Namespace, run_dir: Path, usage_error: type[Exception], out=None
) -> Iterator[DashboardServer | None]:
    """Around a launch: with --dashboard, serve run_dir in a background thread of this (the launcher's) process,
    from before the workers start until the job ends. A busy port raises `usage_error` before anything starts."""
    out = sys.stderr if out is None else out
    port, host = getattr(args, "dashboard", None), getattr(args, "dashboard_host", None)
    if port is None:
        if host is not None:
            raise usage_error("--dashboard-host needs --dashboard [PORT]")
        yield None
        return
    try:
        server = DashboardServer(run_dir, host=host or DEFAULT_HOST, port=port, flag="--dashboard")
        server.start()
    except DashboardError as e:
        raise usage_error(str(e)) from None
    _exposed_warning(server, out)
    print(f"islands: dashboard at {server.url} (read-only, while the job runs)", file=out, flush=True)
    try:
        yield server
    finally:
        server.stop()
        print(
            f"islands: dashboard stopped with the job; to look again: islands dashboard {run_dir}", file=out, flush=True
        )


__all__ = ["add_dashboard_command", "add_train_flags", "cmd_dashboard", "train_dashboard"]
