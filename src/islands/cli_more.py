"""Subcommands whose libraries live in their own packages: testbed, ckpt (and join and stop, with membership)."""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import subprocess
from pathlib import Path

import torch.distributed as dist

from islands.app.elastic_worker import exit_now, run_elastic_worker
from islands.checkpoint.cli import add_ckpt_command
from islands.runtime.elastic import Excluded, JobEnded
from islands.runtime.elastic.membership import (
    ELASTIC_ENV,
    JOB_ENDED_EXIT_CODE,
    NAME_ENV,
    REFUSED_EXIT_CODE,
    TOKEN_ENV,
    JobSpec,
    Refused,
    connect,
    observe,
    parse_address,
)
from islands.runtime.launch.elastic import script_command
from islands.runtime.launch.stop import request_stop
from islands.testbed import cli as tcli


class UsageError(Exception):
    """Raised by subcommands for bad input; the CLI prints it and exits 2."""


def _testbed(args) -> int:
    try:
        if args.action == "up":
            tcli.cmd_up(args.hosts, args.rate, name=args.name, subnet=args.subnet, measure_seconds=args.measure)
        elif args.action == "down":
            tcli.cmd_down(None if args.all else args.name, all_testbeds=args.all)
        elif args.action in ("cut", "heal"):
            tcli.cmd_link(args.action, args.name, args.host)
        else:
            tcli.cmd_status()
    except (ValueError, TypeError, PermissionError, LookupError) as e:
        raise UsageError(str(e)) from None
    return 0


JOIN_CONNECT_S = 10.0  # how long `islands join` and `islands stop` try to reach the job's store


def _answers(address: str, host: str, port: int) -> bool:
    """Whether an embedded store listens at HOST:PORT, said in one clear line when not (torch's own client would
    print its C++ retry log and a stack dump instead). An etcd address has port 0: its client reports cleanly."""
    if not port:
        return True
    try:
        socket.create_connection((host, port), timeout=JOIN_CONNECT_S).close()
    except OSError as e:
        print(
            f"islands: no elastic job answers at {address}: {e.strerror or e} (is the job running, and is this the "
            "address its launcher printed?)",
            flush=True,
        )
        return False
    return True


def _join(args) -> int:
    """islands join HOST:PORT: one elastic worker entering a running job: the job's script (`islands run
    --elastic`) with ISLANDS_ELASTIC set, or islands' own worker (`islands train --elastic`)."""
    try:
        host, port = parse_address(args.address)
    except ValueError as e:
        raise UsageError(str(e)) from None
    token = _token(args)
    name = args.name or f"j{secrets.token_hex(4)}"
    if not _answers(args.address, host, port):
        return JOB_ENDED_EXIT_CODE
    try:
        # verified with the token: a record written without it must not choose what this machine runs
        job = JobSpec.read(connect(host, port, timeout_s=JOIN_CONNECT_S), token, name=name)
    except (dist.DistNetworkError, TimeoutError) as e:
        print(f"islands: no elastic job answers at {args.address}: {e}", flush=True)
        return JOB_ENDED_EXIT_CODE
    except Refused as e:
        print(f"islands: join refused by {args.address}: {e}", flush=True)
        return REFUSED_EXIT_CODE
    if job.script:
        refusal = job.lone_joiner_refusal()
        if refusal:
            print(f"islands: join refused by {args.address}: {refusal}", flush=True)
            return REFUSED_EXIT_CODE
        return _join_script(job, args.address, name, token)
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


def _token(args) -> str:
    """The job's token from --token-file, --token or ISLANDS_TOKEN (in that order of preference)."""
    token = args.token or os.environ.get(TOKEN_ENV, "")
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as e:
            raise UsageError(f"cannot read --token-file {args.token_file!r}: {e.strerror}") from None
    if not token:
        raise UsageError("a token is required: --token T, --token-file PATH or ISLANDS_TOKEN in the environment")
    return token


def _stop(args) -> int:
    """islands stop HOST:PORT --at-step N: every worker of the running elastic job ends at step N
    (islands.runtime.launch.stop)."""
    try:
        host, port = parse_address(args.address)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.at_step < 1:
        raise UsageError(f"--at-step must be >= 1; got {args.at_step}")
    token = _token(args)
    if not _answers(args.address, host, port):
        return JOB_ENDED_EXIT_CODE
    try:
        store = observe(args.address, token, timeout_s=JOIN_CONNECT_S)
    except (dist.DistNetworkError, TimeoutError, ConnectionError) as e:
        print(f"islands: no elastic job answers at {args.address}: {e}", flush=True)
        return JOB_ENDED_EXIT_CODE
    except Refused as e:
        print(f"islands: {args.address} refused the request: {e}", flush=True)
        return REFUSED_EXIT_CODE
    request_stop(store, args.at_step)
    print(
        f"islands: asked the job at {args.address} to end at step {args.at_step}; a worker already past it goes on "
        "to the configured end and says so in its log",
        flush=True,
    )
    return 0


def _join_script(job: JobSpec, address: str, name: str, token: str) -> int:
    """Run the job's script as a worker of its own: its islands.init_world() asks to join (a wrong token
    exits 3, a job that ends first 4) and its strategy's wrap waits for a round boundary. It runs in the
    launcher's directory when this machine has it, so relative paths in the script name the same files."""
    cwd = job.cwd if job.cwd and Path(job.cwd).is_dir() else None
    env = dict(os.environ, **{ELASTIC_ENV: address, TOKEN_ENV: token, NAME_ENV: name}, PYTHONUNBUFFERED="1")
    print(f"islands: joining {address} as {name!r}: {' '.join(job.script)}", flush=True)
    try:
        return subprocess.run(script_command(job), env=env, cwd=cwd, stdin=subprocess.DEVNULL).returncode
    except KeyboardInterrupt:
        return 130


def add_more_commands(sub: argparse._SubParsersAction) -> None:
    jn = sub.add_parser(
        "join",
        help="join a running elastic job (islands train --elastic, islands run --elastic)",
        description="Start one worker that asks the job at HOST:PORT to admit it, receives the "
        "current global model and outer-optimizer state at the next round, and trains "
        "from the round after. What it runs comes from the job itself: the job's config "
        "(islands train), or the job's script with its arguments, in the launcher's "
        "directory (islands run).",
    )
    jn.add_argument("address", help="HOST:PORT of the elastic job's store (printed by its launcher)")
    jn.add_argument(
        "--token",
        default="",
        help="the job's secret (prefer --token-file or ISLANDS_TOKEN: "
        "arguments are visible to other users of this machine)",
    )
    jn.add_argument("--token-file", default="", help="file holding the token (the launcher writes RUN_DIR/token)")
    jn.add_argument("--name", default="", help="this worker's name in the job (default: random)")
    jn.add_argument(
        "--run-dir",
        default="",
        help="where this worker writes its records (default runs/join-NAME; "
        "a script job's worker writes where its script does)",
    )
    jn.set_defaults(fn=_join)
    st = sub.add_parser(
        "stop",
        help="end a running elastic job at a step: every worker stops there, cleanly",
        description="Ask every worker of the elastic job at HOST:PORT to end at step N: each looks "
        "at the request every 0.5 s and ends there as at its configured last step (the "
        "final synchronisation, the records, exit 0). N must lie ahead of the job's "
        "furthest worker by more than half a second of training and a round; a worker "
        "already past it goes on to the configured end and says so in its log.",
    )
    st.add_argument("address", help="HOST:PORT (or etcd://...) of the elastic job's store (printed by its launcher)")
    st.add_argument("--at-step", type=int, required=True, help="the step every worker ends at")
    st.add_argument("--token", default="", help="the job's secret (prefer --token-file or ISLANDS_TOKEN)")
    st.add_argument("--token-file", default="", help="file holding the token (the launcher writes RUN_DIR/token)")
    st.set_defaults(fn=_stop)
    tb = sub.add_parser(
        "testbed",
        help="real rate-limited links: hosts as network namespaces (root)",
        description="Create, inspect and remove a network testbed; `islands train --testbed NAME` "
        "then runs each worker inside one of its hosts.",
    )
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
    for action, what in (
        ("cut", "take host HOST's link down at the bridge (a network partition)"),
        ("heal", "bring a cut link back up"),
    ):
        link = tsub.add_parser(action, help=what)
        link.add_argument("host", type=int, help="the host's index (0 .. hosts-1)")
        link.add_argument("--name", default="default")
    tb.set_defaults(fn=_testbed)

    add_ckpt_command(sub, UsageError)  # islands ckpt ls|verify|inspect|diff|compress|decompress
