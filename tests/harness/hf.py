"""Run a tiny hf-causal-lm job on N gloo ranks forked from the test process: the worker's own code
(`islands.app.worker.run_worker`, what `islands train` starts per rank) without paying a fresh interpreter's
torch and transformers imports per rank. Shared by tests/integration/hf/test_hf_task.py and
tests/integration/hf/test_export.py.

    record = run_hf_job(run_dir, workers=2, inner="fsdp", **{"task.model": "llama"})   # run.json, parsed

The config is validated first (as `islands train` does) and written to RUN_DIR/config.json; a rank that fails
prints its traceback and the job fails with every rank's exit code.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sysconfig
import traceback
from pathlib import Path

from harness.procs import free_port
from islands.app.validate import validate
from islands.app.worker import run_worker
from islands.config import dump_json, from_mapping

JSON_PKG = Path(sysconfig.get_paths()["stdlib"]) / "json"  # five files, ~48 KB of text every Python has
TINY = {
    "task": "hf-causal-lm",
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 2,
    "context": 32,
    "task.vocab_size": 320,
    "data": str(JSON_PKG),
    "steps": 4,
    "global_batch": 4,
    "eval_every": 0,
    "eval_batches": 2,
    "probe": False,
    "progress": False,
    "warmup": 0,
    "timeout": 60,
    "threads": 1,
}


def _rank(rank: int, n: int, port: int, cfg, run_dir: Path) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(n),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(n),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    try:
        run_worker(cfg, run_dir)
    except BaseException:  # noqa: BLE001 - a rank's failure is reported by its exit code, after its traceback
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def run_hf_job(run_dir: Path, timeout: float = 180, **overrides) -> dict:
    cfg = validate(from_mapping({**TINY, "run_dir": str(run_dir), **overrides}))
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_json(cfg, run_dir / "config.json")
    ctx, port = mp.get_context("fork"), free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, cfg.world.workers, port, cfg, run_dir)) for r in range(cfg.world.workers)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs]
    assert codes == [0] * len(procs), f"rank exit codes {codes}"
    return json.loads((run_dir / "run.json").read_text())
