"""Launch a configured job: the config becomes a config.json, the ranks run islands' worker on it.

The supervision, ports and testbed placement are islands.runtime.launch.ranks's (`islands run` uses the same
launcher for any script); this module adds what only a configured job has: its config file, the wire
bytes a testbed's shaped links carried (into run.json), and the elastic launcher's shared config.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path

import torch
from rich.console import Console

from islands.app.build import run_job
from islands.config import JobConfig, dump_json
from islands.measure.progress import print_finished
from islands.measure.record import LAUNCHER_PLOTS_ENV, plot_finished_run
from islands.runtime import simulate
from islands.runtime.contracts import ServedParticipant
from islands.runtime.elastic.etcd_store import EtcdAddress
from islands.runtime.elastic.membership import JobSpec
from islands.runtime.launch import spawn
from islands.runtime.launch.elastic import launch_elastic_workers
from islands.runtime.launch.ranks import Placement, load_testbed, run_ranks
from islands.sync.outer import make_outer
from islands.tasks import heavy_imports
from islands.testbed import Testbed, wire_bytes

WORKER_MODULE = "islands.app.worker"  # `python -m WORKER_MODULE CONFIG RUN_DIR`
ELASTIC_WORKER_MODULE = "islands.app.elastic_worker"  # `python -m ELASTIC_WORKER_MODULE HOST:PORT RUN_DIR`


def launch(cfg: JobConfig, run_dir: Path, out=None) -> int:
    """Run the job; returns the exit code the CLI should use (0 on success). Raises
    islands.runtime.launch.ranks.LaunchError (a busy port, a testbed that does not exist) before any worker starts.
    `out`: where the launcher's lines go, sys.stderr as it is at the call (a default bound at import kept the stream
    a notebook or test harness had replaced since)."""
    out = sys.stderr if out is None else out
    if cfg.elastic.enabled:  # workers may die and join (docs/membership.md)
        return launch_elastic(cfg, run_dir, out)
    if cfg.world.simulate:  # the islands as threads of this process (docs/simulate.md)
        return launch_simulated(cfg, run_dir, out)
    world = cfg.world
    placement = Placement.on_testbed(world.testbed, world.port) if world.testbed else Placement.loopback(world.port)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / "config.json"
    dump_json(cfg, cfg_path)
    before = _wire_counters(placement.testbed)
    # authenticated payloads: the workers' shared secret, made here unless the user gave one (never written down)
    env = (
        {"ISLANDS_TOKEN": secrets.token_hex(32)}
        if cfg.outer.authenticate and not os.environ.get("ISLANDS_TOKEN")
        else {}
    )
    env[LAUNCHER_PLOTS_ENV] = "1"  # rank 0 writes run.json; loss.png is drawn here, after the job
    code = run_ranks(
        [sys.executable, "-m", WORKER_MODULE, str(cfg_path), str(run_dir)],
        world.workers,
        placement,
        islands=world.islands,
        threads=world.threads,
        run_dir=run_dir,
        out=out,
        env=env,
    )
    if code == 0 and placement.testbed is not None:
        _record_wire_bytes(run_dir, placement.testbed, before)
    plot_finished_run(run_dir)
    return code


def launch_simulated(cfg: JobConfig, run_dir: Path, out=None) -> int:
    """The job's islands as threads of this process on one device (islands.runtime.simulate): each runs the same
    worker body as a process would; rank 0 writes run.json."""
    out = sys.stderr if out is None else out
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_json(cfg, run_dir / "config.json")
    gpu = cfg.world.device == "cuda" or (cfg.world.device == "auto" and torch.cuda.is_available())
    device = "cuda" if gpu else "cpu"
    try:  # an island waits for up to M-1 others' steps in turn: never less than the simulation's own timeout
        simulate.run(
            lambda world: run_job(cfg, world, run_dir),
            islands=cfg.world.islands,
            device=device,
            timeout_s=max(cfg.world.timeout, simulate.DEFAULT_TIMEOUT_S),
        )
    except RuntimeError as e:
        print(f"islands: {e}", file=out, flush=True)
        return 1
    return 0


def _wire_counters(testbed: Testbed | None) -> list[tuple[int, int]] | None:
    if testbed is None:
        return None
    return [wire_bytes(testbed, h.index) for h in testbed.hosts]


def _record_wire_bytes(run_dir: Path, testbed: Testbed, before) -> None:
    """Bytes the shaped links really carried (headers included), next to the ledger's payload count."""
    after = _wire_counters(testbed)
    assert after is not None  # a testbed is given
    path = run_dir / "run.json"
    if not path.exists():
        return
    rec = json.loads(path.read_text())
    rec["interconnect"]["wire_bytes_per_host"] = [
        {"host": i, "tx": a[0] - b[0], "rx": a[1] - b[1]} for i, (a, b) in enumerate(zip(after, before))
    ]
    path.write_text(json.dumps(rec, indent=2, default=str))


# ---- elastic jobs ----------------------------------------------------------------------------
def shared_config(cfg: JobConfig, run_dir: Path) -> dict:
    """The config every worker of the job reads from its store, joiners included. Checkpoint roots are
    absolute and the job's own: a save commits only once every member's part is in one directory, and a
    joiner runs elsewhere (its own --run-dir, its own working directory)."""
    shared = cfg.to_dict()
    shared["checkpoint"]["dir"] = str(Path(cfg.checkpoint.dir or run_dir / "ckpt").resolve())
    if cfg.checkpoint.remote_dir:
        shared["checkpoint"]["remote_dir"] = str(Path(cfg.checkpoint.remote_dir).resolve())
    return shared


def elastic_job(cfg: JobConfig, run_dir: Path) -> JobSpec:
    """The job's record in its store: the members are the islands (their leaders), each island's
    workers_per_island workers start together; `served` is the outer strategy's side of admission: a
    ServedParticipant's joiners pull the model from its service, so the launcher restarts islands with no live
    member to let them in (islands.runtime.launch.elastic.join_rule)."""
    outer = cfg.outer.strategy  # validate requires one in an elastic job
    return JobSpec(
        workers=cfg.world.islands,
        heartbeat_timeout=cfg.elastic.heartbeat_timeout,
        timeout=cfg.world.timeout,
        config=shared_config(cfg, run_dir),
        island_size=cfg.workers_per_island,
        served=outer is not None and isinstance(make_outer(outer, warmup=cfg.train.warmup), ServedParticipant),
    )


def launch_elastic(cfg: JobConfig, run_dir: Path, out=None, on_started=None) -> int:
    """Run an elastic job (islands.runtime.launch.elastic); `on_started(address, workers, coordinator)` lets
    experiments inject faults."""
    out = sys.stderr if out is None else out
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_json(cfg, run_dir / "config.json")
    job = elastic_job(cfg, run_dir)
    testbed = load_testbed(cfg.world.testbed) if cfg.world.testbed else None  # island i on host i % hosts
    before = _wire_counters(testbed)
    spawn.preload(heavy_imports(cfg.task.name))  # not imported by a worker whose heartbeat runs already
    code = launch_elastic_workers(
        lambda address: [sys.executable, "-m", ELASTIC_WORKER_MODULE, address, str(run_dir)],
        job,
        run_dir,
        port=cfg.world.port,
        threads=cfg.world.threads,
        out=out,
        on_started=on_started,
        max_restarts=cfg.elastic.max_restarts,
        store=EtcdAddress.parse(cfg.elastic.store) if cfg.elastic.store else None,
        testbed=testbed,
        env={LAUNCHER_PLOTS_ENV: "1"},  # the worker that writes run.json leaves loss.png to this launcher
    )
    if code == 0 and testbed is not None:
        _record_wire_bytes(run_dir, testbed, before)
    plot_finished_run(run_dir)
    if code == 0 and (run_dir / "run.json").is_file():  # the workers' output went to their logs: say how it went here
        print_finished(json.loads((run_dir / "run.json").read_text()), Console(file=out))
    return code
