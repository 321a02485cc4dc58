"""One worker process of `islands train`: join the world, run the job, write the record (rank 0), leave.

Started by the launcher (`python -m islands.app.worker CONFIG RUN_DIR`) or by torchrun through
`islands train`; both set torch's env:// variables.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from islands.app.build import run_job
from islands.config import JobConfig, load_json
from islands.measure.record import worker_plots
from islands.runtime.world import close_world, init_world


def run_worker(cfg: JobConfig, run_dir: Path, plot: bool = True) -> dict:
    world = init_world(
        cfg.world.islands,
        cfg.world.timeout,
        device=cfg.world.device,
        cross_backend=cfg.world.cross_backend,
        gloo_links=bool(cfg.world.testbed),
    )
    try:
        return run_job(cfg, world, run_dir, plot)
    finally:
        close_world(world)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = load_json(Path(argv[0]))
    try:
        run_worker(cfg, Path(argv[1]), plot=worker_plots())
    except Exception:  # noqa: BLE001 - the process's last frame: any failure is a traceback and exit 1
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
