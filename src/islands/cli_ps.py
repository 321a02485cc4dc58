"""`islands ps-host`: run a job's parameter servers on a machine with no island (issue #36; ps_host.py)."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from islands.cli_more import UsageError
from islands.runtime.elastic.membership import TOKEN_ENV
from islands.sync.outer import ps_host
from islands.sync.outer.ps_service import advertised_host


def _token(token_file: str) -> str:
    """The job's token from --token-file, else ISLANDS_TOKEN."""
    if token_file:
        try:
            return Path(token_file).read_text().strip()
        except OSError as e:
            raise UsageError(f"cannot read --token-file {token_file!r}: {e.strerror}") from None
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise UsageError(
            f"the job's token is required: --token-file PATH or {TOKEN_ENV} in the environment (the islands' own; "
            "the host accepts only a configuration sealed with it)"
        )
    return token


def _ps_host(args) -> int:
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be 0..65535 (0: any free port), got {args.port}")
    if not args.wait > 0:
        raise UsageError(f"--wait must be > 0 seconds, got {args.wait}")
    token = _token(args.token_file)  # never on the command line: other users of the machine see arguments
    try:
        advertise = args.advertise or advertised_host()
    except RuntimeError as e:
        raise UsageError(f"{e}; or give --advertise ADDRESS") from None
    scratch = None if args.dir else tempfile.mkdtemp(prefix="islands-ps-host-")
    directory = args.dir or scratch
    assert directory is not None
    if args.dir and Path(args.dir).exists() and any(Path(args.dir).iterdir()):
        raise UsageError(f"--dir {args.dir} is not empty: the servers' journals of one job go in a fresh directory")
    try:
        return ps_host.main(directory, token, args.port, advertise, args.wait)
    except ps_host.AddressInUse as e:
        raise UsageError(str(e)) from None
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def add_ps_host_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ps-host",
        help="run a job's parameter servers on this machine (an island-free host; ps:...,at=HOST:PORT)",
        description="Host the parameter server's store on PORT and wait for a job whose outer strategy names this "
        "host (ps:inner_steps=H,servers=S,at='HOST:PORT'). Its island 0 sends the servers' configuration, sealed with "
        "the job's token; the supervisor and its S servers then run here until the job ends, and the servers' "
        "report goes back to island 0. One job per start; exits 0 when it ended, 1 when none came within --wait.",
    )
    p.add_argument("--port", type=int, default=0, help="the store's TCP port (default 0: any free one, printed)")
    p.add_argument(
        "--advertise",
        default="",
        help="the address islands reach this host by (default: the interface in GLOO_SOCKET_IFNAME, else 127.0.0.1)",
    )
    p.add_argument(
        "--dir",
        default="",
        help="an empty directory for the configuration and the servers' journals (default: a temporary one, removed "
        "at the end)",
    )
    p.add_argument("--wait", type=float, default=600.0, help="seconds to wait for a job (default 600)")
    p.add_argument("--token-file", default="", help="file holding the job's token (default: ISLANDS_TOKEN)")
    p.set_defaults(fn=_ps_host)
