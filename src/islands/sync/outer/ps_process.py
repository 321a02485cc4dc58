"""The parameter server's processes (issue #36): `python -m islands.sync.outer.ps_process serve DIR SHARD HOST PORT`
runs one shard server, `... supervise DIR [HOST]` the supervisor that hosts the store and restarts the servers
(ps_service.py). A module of its own, which nothing in islands imports: run with -m, a module the package had imported
already would be executed a second time (runpy warns).
A supervisor whose directory holds the file SCRATCH (a temporary directory the starting island made) removes the
directory when it ends if that island is gone (nobody else knows the path); in a fixed job a living one waits for the
supervisor, reads the servers' report from the directory (ps_report.py) and removes it itself. An elastic job's
supervisor (one that outlives its starter) hands the report over through its store instead (ps_report.hand_over:
the island that writes run.json may not be the one that started it), so nobody reads the directory, and it removes
the directory itself, once."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

from islands.sync.outer.ps_report import hand_over, read_collected
from islands.sync.outer.ps_service import SCRATCH, Supervisor, serve


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 5 and args[0] == "serve":
        serve(args[1], int(args[2]), args[3], int(args[4]))
        return 0
    if len(args) in (2, 3) and args[0] == "supervise":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        starter = os.getppid()  # the island that launched it (a process of its own session, not of its group)

        def starter_alive() -> bool:  # once the starter dies, this process is someone else's child
            return os.getppid() == starter

        outlives_starter = False  # an elastic job's service: it hands its report over and cleans up after itself
        try:
            host = args[2] if len(args) == 3 else "127.0.0.1"  # how islands reach it
            supervisor = Supervisor(args[1], host, starter_alive=starter_alive)
            outlives_starter = not supervisor.config.ends_with_starter
            supervisor.run()
            if outlives_starter:  # the island that writes run.json may have started nothing: the store carries it
                config = supervisor.config
                hand_over(supervisor.store, read_collected(args[1]), 2 * config.lease_s, config.timeout_s)
        finally:
            # the directory is ours to remove once nobody needs it: in an elastic job always (the report went
            # through the store), in a fixed one only when the starter died (a living one reads it, then removes it)
            if (Path(args[1]) / SCRATCH).exists() and (outlives_starter or not starter_alive()):
                shutil.rmtree(args[1], ignore_errors=True)
        return 0
    print(
        "usage: python -m islands.sync.outer.ps_process serve DIR SHARD HOST PORT | supervise DIR [HOST]",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
