"""Where one worker's seconds went, round by round, from a run's live log (session 39, issue #36): for every logged
step that ends a round of H steps, the wall seconds since the run began and since the last such step, and the
worker's own training and blocked seconds so far (time/elapsed_s, time/blocked_s). A round that took longer than its
neighbours with its blocked seconds jumping is one whose exchange waited (a window held for another island, a
round boundary waiting for a dead one's timeout):

    python scripts/ps_blocked_rounds.py RUN_DIR [--worker w0] [--h 25]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rounds(run_dir: Path, worker: str, h: int) -> list[tuple[int, float, float, float, float]]:
    """(step, seconds since the first entry, seconds since the previous row, training seconds, blocked seconds)."""
    rows: list[tuple[int, float, float, float, float]] = []
    start = previous = None
    for line in (run_dir / "live" / f"{worker}.jsonl").read_text().splitlines():
        entry = json.loads(line)
        start = entry["t"] if start is None else start
        metrics = entry.get("metrics", {})
        step = entry.get("step")
        if entry.get("kind") != "metrics" or not isinstance(step, int) or "time/blocked_s" not in metrics:
            continue
        if step % h == 0 or step == 1:
            since = entry["t"] - (previous if previous is not None else start)
            rows.append((step, entry["t"] - start, since, metrics["time/elapsed_s"], metrics["time/blocked_s"]))
            previous = entry["t"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--worker", default="w0", help="the live log's name (default w0: rank 0)")
    parser.add_argument("--h", type=int, default=25, help="inner steps per round")
    args = parser.parse_args()
    print("step  wall_s  round_s  training_s  blocked_s")
    for step, wall, since, elapsed, blocked in rounds(args.run_dir, args.worker, args.h):
        print(f"{step:4d}  {wall:6.1f}  {since:7.1f}  {elapsed:10.2f}  {blocked:9.2f}")


if __name__ == "__main__":
    main()
