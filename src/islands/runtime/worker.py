"""One worker process: join the world, train, write the record (rank 0), leave.

Started by our launcher (`python -m islands.runtime.worker CONFIG RUN_DIR`) or by torchrun through
`islands train`; both set torch's env:// variables.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from islands.config import TrainConfig, load_json
from islands.runtime.world import close_world, init_world


def run_worker(cfg: TrainConfig, run_dir: Path) -> dict:
    from islands.trainer import Trainer

    world = init_world(cfg.islands, cfg.timeout, device=cfg.device)
    try:
        trainer = Trainer(cfg, world, run_dir)
        if cfg.resume:
            from islands.checkpoint.resume import resume_trainer

            resume_trainer(trainer, cfg.resume)
        return trainer.run()
    finally:
        close_world(world)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = load_json(Path(argv[0]))
    try:
        run_worker(cfg, Path(argv[1]))
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
