"""`islands run`: start N ranks of a user's script the way `islands train` starts its workers.

The script joins with torch's env:// rendezvous (`torch.distributed.init_process_group()` or
`islands.init_world()`), so the same script also runs under torchrun. Everything after the script's
path is the script's own, passed through untouched (flags included).

`--elastic`: the workers form an elastic job instead (islands.runtime.launch.elastic): the script joins
with `islands.init_world()`, any worker may die while the others carry on, and `islands join` adds
workers that enter at the outer strategy's round boundaries (docs/membership.md).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from islands.cli_more import UsageError
from islands.runtime.elastic.etcd_store import EtcdAddress
from islands.runtime.launch import spawn
from islands.runtime.launch.elastic import launch_elastic_script
from islands.runtime.launch.ranks import (
    LaunchError,
    Placement,
    check_counts,
    load_testbed,
    run_island_jobs,
    run_ranks,
)


def cmd_run(args: argparse.Namespace) -> int:
    script = Path(args.script)
    if not script.is_file():
        what = "is a directory" if script.is_dir() else "does not exist"
        raise UsageError(
            f"script {args.script!r} {what}; give the path of a Python file, "
            f"e.g. `islands run --workers 2 train.py --lr 3e-4`"
        )
    run_dir = Path(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{script.stem}-w{args.workers}")
    if args.elastic and args.separate_jobs:
        raise UsageError("--elastic and --separate-jobs are two kinds of job; give one of them")
    with _preloading(_preload_modules(args.preload)):
        if args.elastic:
            return _run_elastic(args, script, run_dir)
        if args.separate_jobs:
            return _run_separate(args, script, run_dir)
        return _run_ranks(args, script, run_dir)


_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _preload_modules(text: str) -> tuple[str, ...]:
    """--preload's modules; a name that is not a module path, or whose package is not installed, is refused (a
    typo would otherwise just leave every rank importing it itself)."""
    names = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    for name in names:
        if not _MODULE_NAME.fullmatch(name):
            raise UsageError(f"--preload: {name!r} is not a module name; give dotted names, e.g. transformers,numpy")
        if importlib.util.find_spec(name.partition(".")[0]) is None:
            raise UsageError(
                f"--preload: no package {name.partition('.')[0]!r} is installed for {sys.executable}; give modules "
                "the script imports (e.g. transformers, lightning), or leave --preload out"
            )
    return names


@contextlib.contextmanager
def _preloading(modules: tuple[str, ...]) -> Iterator[None]:
    """The ranks (and an elastic job's workers, through its launcher's environment) get ISLANDS_PRELOAD while the
    job runs: their launcher then forks them from a server that imported `modules` (islands.runtime.launch.spawn).
    Set for this job only: a launcher called in-process (a test, a notebook) keeps its environment."""
    if not modules:
        yield
        return
    before = os.environ.get(spawn.PRELOAD_ENV)
    os.environ[spawn.PRELOAD_ENV] = ",".join(modules)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(spawn.PRELOAD_ENV, None)
        else:
            os.environ[spawn.PRELOAD_ENV] = before


def _run_ranks(args: argparse.Namespace, script: Path, run_dir: Path) -> int:
    elastic_only = [
        flag
        for flag, value, default in (
            ("--heartbeat-timeout", args.heartbeat_timeout, None),
            ("--store", args.store, ""),
            ("--max-restarts", args.max_restarts, 0),
            ("--timeout", args.timeout, None),
        )
        if value != default
    ]
    if elastic_only:
        raise UsageError(f"{', '.join(elastic_only)} apply to elastic jobs only; add --elastic or leave them out")
    try:  # launch_ranks, with a line saying where the logs go once the input is known to work
        check_counts(args.workers, args.islands, args.threads)
        placement = Placement.on_testbed(args.testbed, args.port) if args.testbed else Placement.loopback(args.port)
    except LaunchError as e:
        raise UsageError(str(e)) from None
    where = f"testbed {args.testbed!r}" if args.testbed else f"{placement.master_addr}:{placement.port}"
    print(
        f"islands: {args.workers} rank(s) of {script} ({where}); logs in {run_dir / 'logs'}",
        file=sys.stderr,
        flush=True,
    )
    return run_ranks(
        [sys.executable, str(script), *args.args],
        args.workers,
        placement,
        islands=args.islands,
        threads=args.threads,
        run_dir=run_dir,
    )


def _run_separate(args: argparse.Namespace, script: Path, run_dir: Path) -> int:
    """--separate-jobs: each island its own job (own rendezvous and default group), joined across by islands."""
    refused = [
        flag
        for flag, value, default in (
            ("--testbed", args.testbed, ""),
            ("--port", args.port, 0),
            ("--store", args.store, ""),
            ("--max-restarts", args.max_restarts, 0),
        )
        if value != default
    ]
    if refused:
        raise UsageError(
            f"{', '.join(refused)} do not apply to --separate-jobs (each island picks a free port on this machine; "
            f"the cross-island timeouts are --timeout and --heartbeat-timeout); leave them out"
        )
    for flag, value in (("--timeout", args.timeout), ("--heartbeat-timeout", args.heartbeat_timeout)):
        if value is not None and value <= 0:
            raise UsageError(f"{flag} must be a positive number of seconds; got {value}")
    if args.islands < 2:
        raise UsageError(f"--separate-jobs needs --islands K with K >= 2 (one job per island); got {args.islands}")
    try:
        check_counts(args.workers, args.islands, args.threads)
    except LaunchError as e:
        raise UsageError(str(e)) from None
    print(
        f"islands: {args.islands} island job(s) of {args.workers // args.islands} rank(s) of {script}, joined "
        f"across; logs in {run_dir / 'logs'}",
        file=sys.stderr,
        flush=True,
    )
    return run_island_jobs(
        [sys.executable, str(script), *args.args],
        args.workers,
        args.islands,
        threads=args.threads,
        run_dir=run_dir,
        cross_timeout_s=args.timeout,
        heartbeat_timeout_s=args.heartbeat_timeout,
    )


def _run_elastic(args: argparse.Namespace, script: Path, run_dir: Path) -> int:
    islands = args.workers if args.islands == 1 else args.islands  # default: one worker per island
    if islands < 1 or args.workers % islands:
        raise UsageError(
            f"--islands {args.islands} does not divide --workers {args.workers} into islands of equal "
            f"size; give a divisor of {args.workers} (or leave --islands out: one worker per island)"
        )
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0; got {args.max_restarts}")
    heartbeat = 3.0 if args.heartbeat_timeout is None else args.heartbeat_timeout
    timeout = 120.0 if args.timeout is None else args.timeout
    for flag, value in (("--heartbeat-timeout", heartbeat), ("--timeout", timeout)):
        if not value > 0:
            raise UsageError(f"{flag} must be > 0 seconds; got {value}")
    try:
        check_counts(args.workers, 1, args.threads)
        if args.port and not 0 < args.port < 65536:
            raise LaunchError(f"port must be in 1..65535 (or 0 to pick a free one); got {args.port}")
        store = EtcdAddress.parse(args.store) if args.store else None
        testbed = load_testbed(args.testbed) if args.testbed else None  # worker i on host i % hosts
        print(
            f"islands: elastic job of {args.workers} worker(s) of {script}; logs in {run_dir / 'logs'}",
            file=sys.stderr,
            flush=True,
        )
        return launch_elastic_script(
            [str(script), *args.args],
            args.workers,
            run_dir,
            heartbeat_timeout=heartbeat,
            timeout=timeout,
            port=args.port,
            threads=args.threads,
            store=store,
            testbed=testbed,
            islands=islands,
            max_restarts=args.max_restarts,
        )
    except (LaunchError, ValueError) as e:  # ValueError: a --store that is not etcd://HOST:PORT,...
        raise UsageError(f"--store: {e}" if isinstance(e, ValueError) else str(e)) from None


def add_run_command(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser(
        "run",
        help="launch any script as N ranks (env:// rendezvous, like torchrun), supervised",
        description="Start N ranks of SCRIPT, each with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, "
        "MASTER_PORT, OMP_NUM_THREADS and ISLANDS_ISLANDS set. If one rank fails or is killed, the others "
        "are stopped and its log tail is shown. Rank r logs to RUN_DIR/logs/rank<r>.log; rank 0's "
        "stdout stays on this terminal. Arguments after SCRIPT are the script's own. With --elastic the "
        "workers (ISLANDS_ELASTIC, ISLANDS_TOKEN, ISLANDS_NAME set; logs in RUN_DIR/logs/w<i>.log) form an "
        "elastic job: a worker that dies is dropped and the others carry on, `islands join` adds workers.",
        usage="islands run [--workers N] [--islands K] [--testbed NAME] [--port P] [--threads T] [--run-dir DIR] "
        "[--elastic [--heartbeat-timeout S] [--timeout S] [--max-restarts N] [--store etcd://H:P,...]] "
        "[--separate-jobs [--timeout S] [--heartbeat-timeout S]] [--preload MODULE,...] "
        "script.py [ARGS...]",
    )
    r.add_argument("--workers", type=int, default=2, metavar="N", help="ranks to start (default 2)")
    r.add_argument(
        "--islands",
        type=int,
        default=1,
        metavar="K",
        help="islands the ranks form, read by islands.init_world() through ISLANDS_ISLANDS (default 1; with "
        "--elastic default one worker per island, and an island of several joins and leaves whole)",
    )
    r.add_argument(
        "--testbed",
        default="",
        metavar="NAME",
        help="run rank r inside host r %% hosts of this network testbed (`islands testbed up`)",
    )
    r.add_argument(
        "--port",
        type=int,
        default=0,
        metavar="P",
        help="rendezvous port (default 0: a free one; a busy port is refused)",
    )
    r.add_argument("--threads", type=int, default=1, metavar="T", help="OMP_NUM_THREADS per rank (default 1)")
    r.add_argument(
        "--run-dir",
        default="",
        metavar="DIR",
        help="where logs/ goes (default runs/<time>-<script>-w<N>); with --elastic also the job's token",
    )
    r.add_argument(
        "--elastic",
        action="store_true",
        help="an elastic job: the script joins with islands.init_world() and trains with an outer strategy; "
        "a worker that dies is dropped, `islands join HOST:PORT` adds one at a round boundary "
        "(docs/membership.md)",
    )
    r.add_argument(
        "--separate-jobs",
        action="store_true",
        help="each of the --islands K islands its own job (own rendezvous, MASTER_PORT and default process group, "
        "as a torchrun per island), joined across by islands (ISLANDS_CROSS_* set); for scripts whose framework "
        "runs DDP over the default group (Hugging Face Trainer, Lightning, accelerate; docs/frameworks.md). An "
        "island that fails is stopped alone; the others go on",
    )
    r.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=None,
        metavar="S",
        help="with --elastic: seconds without a heartbeat before a worker counts as gone (default 3); with "
        "--separate-jobs: before an island counts as gone (default 10)",
    )
    r.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="with --elastic: seconds a collective may take before a worker counts as stuck (default 120); with "
        "--separate-jobs: a cross-island collective, before its island is dropped (default 300)",
    )
    r.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="with --elastic: times the launcher starts a failed island again (default 0)",
    )
    r.add_argument(
        "--store",
        default="",
        metavar="etcd://H:P,H:P,...",
        help="with --elastic: keep the job in this etcd cluster (its members' client addresses) instead of "
        "the job host's embedded store: no single point of failure; etcds://... over TLS, with "
        "ISLANDS_ETCD_CA, ISLANDS_ETCD_CERT, ISLANDS_ETCD_KEY; a cluster with etcd's own login "
        "needs ISLANDS_ETCD_USER and ISLANDS_ETCD_PASSWORD_FILE (docs/membership.md)",
    )
    r.add_argument(
        "--preload",
        default="",
        metavar="MODULE,...",
        help="import these modules once, in a server process, and fork every rank (and every restarted island) "
        "from it instead of starting a fresh interpreter: the ranks skip that import (`from transformers import "
        "Trainer` is ~5 s of CPU a rank, `import lightning` ~5.5 s). A preloaded module reads its environment "
        "once, the launcher's; default: every rank a fresh interpreter, as torchrun starts them (docs/frameworks.md)",
    )
    r.add_argument("script", help="the Python script every rank runs")
    r.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments, passed through untouched")
    r.set_defaults(fn=cmd_run)
