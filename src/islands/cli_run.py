"""`islands run`: start N ranks of a user's script the way `islands train` starts its workers.

The script joins with torch's env:// rendezvous (`torch.distributed.init_process_group()` or
`islands.init_world()`), so the same script also runs under torchrun. Everything after the script's
path is the script's own, passed through untouched (flags included).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from islands.cli_more import UsageError
from islands.runtime.launch import LaunchError, Placement, check_counts, run_ranks


def cmd_run(args: argparse.Namespace) -> int:
    script = Path(args.script)
    if not script.is_file():
        what = "is a directory" if script.is_dir() else "does not exist"
        raise UsageError(f"script {args.script!r} {what}; give the path of a Python file, "
                         f"e.g. `islands run --workers 2 train.py --lr 3e-4`")
    run_dir = Path(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{script.stem}-w{args.workers}")
    try:  # launch_ranks, with a line saying where the logs go once the input is known to work
        check_counts(args.workers, args.islands, args.threads)
        placement = Placement.on_testbed(args.testbed, args.port) if args.testbed else Placement.loopback(args.port)
    except LaunchError as e:
        raise UsageError(str(e)) from None
    where = f"testbed {args.testbed!r}" if args.testbed else f"{placement.master_addr}:{placement.port}"
    print(f"islands: {args.workers} rank(s) of {script} ({where}); logs in {run_dir / 'logs'}",
          file=sys.stderr, flush=True)
    return run_ranks([sys.executable, str(script), *args.args], args.workers, placement, islands=args.islands,
                     threads=args.threads, run_dir=run_dir)


def add_run_command(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser(
        "run", help="launch any script as N ranks (env:// rendezvous, like torchrun), supervised",
        description="Start N ranks of SCRIPT, each with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, "
                    "MASTER_PORT, OMP_NUM_THREADS and ISLANDS_ISLANDS set. If one rank fails or is killed, the others "
                    "are stopped and its log tail is shown. Rank r logs to RUN_DIR/logs/rank<r>.log; rank 0's "
                    "stdout stays on this terminal. Arguments after SCRIPT are the script's own.",
        usage="islands run [--workers N] [--islands K] [--testbed NAME] [--port P] [--threads T] [--run-dir DIR] "
              "script.py [ARGS...]")
    r.add_argument("--workers", type=int, default=2, metavar="N", help="ranks to start (default 2)")
    r.add_argument("--islands", type=int, default=1, metavar="K",
                   help="islands the ranks form, read by islands.init_world() through ISLANDS_ISLANDS (default 1)")
    r.add_argument("--testbed", default="", metavar="NAME",
                   help="run rank r inside host r %% hosts of this network testbed (`islands testbed up`)")
    r.add_argument("--port", type=int, default=0, metavar="P",
                   help="rendezvous port (default 0: a free one; a busy port is refused)")
    r.add_argument("--threads", type=int, default=1, metavar="T", help="OMP_NUM_THREADS per rank (default 1)")
    r.add_argument("--run-dir", default="", metavar="DIR",
                   help="where logs/ goes (default runs/<time>-<script>-w<N>)")
    r.add_argument("script", help="the Python script every rank runs")
    r.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments, passed through untouched")
    r.set_defaults(fn=cmd_run)
