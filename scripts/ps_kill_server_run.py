"""An `islands train` run of the parameter server's process mode with its server SIGKILLed mid-run (issue #36, part
2; docs/parameter-server.md): the tiny byte LM on 2 islands, `ps:inner_steps=4,servers=1,lease=5`, 60 steps; a
thread finds the shard server's process and kills it `--after` seconds after it appears. Prints the exit code, the
wall time and when the kill happened; the ranks' logs show their reconnects while the supervisor restarts it.

    PYTHONPATH=src:tests python scripts/ps_kill_server_run.py RUN_DIR [--after 8]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import threading
import time

from harness.cli import TINY_FLAGS, islands_cli


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--after", type=float, default=8.0)
    args = p.parse_args()
    killed: list[float] = []

    def killer() -> None:
        deadline = time.time() + 400
        while time.time() < deadline and not killed:
            pids = subprocess.run(
                ["pgrep", "-f", "islands.sync.outer.ps_process serve"], capture_output=True, text=True
            ).stdout.split()
            if pids:
                time.sleep(args.after)
                for pid in pids:
                    os.kill(int(pid), signal.SIGKILL)
                killed.append(time.time())
            time.sleep(0.2)

    threading.Thread(target=killer, daemon=True).start()
    start = time.time()
    argv = ["train", "--workers", "2", "--islands", "2", "--outer", "ps:inner_steps=4,servers=1,lease=5"]
    rc = islands_cli(*argv, "--steps", "60", "--output.run_dir", args.run_dir, *TINY_FLAGS)
    at = [time.strftime("%H:%M:%S", time.gmtime(t)) for t in killed]
    print(f"exit {rc}, wall {time.time() - start:.1f} s, server SIGKILLed at {at} UTC")


if __name__ == "__main__":
    main()
