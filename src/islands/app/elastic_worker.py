"""One elastic worker of `islands train --elastic`: join, train the job's config with the Trainer, leave.

    python -m islands.app.elastic_worker HOST:PORT RUN_DIR
with ISLANDS_TOKEN (the job's secret) and ISLANDS_NAME (this process's name) in the environment.
The launcher starts the first job.workers this way; `islands join` starts later ones the same way.
In a job of k-worker islands (docs/membership.md, "Islands of k workers") the launcher starts each island's k
workers with ISLANDS_ISLAND (their place) and restarts a failed island itself; `islands join` is refused there.
Joining, the World and the joins at round boundaries are islands.runtime's, as for any script under
`islands run --elastic` (the Trainer's Stack holds the membership; there is no callback of its own).
A refused process logs one line and exits with code 3 (membership.REFUSED_EXIT_CODE).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from islands.app.build import build_trainer, report_writer, resume_trainer
from islands.config import from_mapping
from islands.measure.record import worker_plots
from islands.runtime.elastic import Excluded, JobEnded, Membership, global_digest
from islands.runtime.elastic.island_comm import ISLAND_ENV, IslandBroken, IslandFollower, IslandPlace
from islands.runtime.elastic.membership import (
    JOB_ENDED_EXIT_CODE,
    NAME_ENV,
    REFUSED_EXIT_CODE,
    TOKEN_ENV,
    JobSpec,
    Refused,
    connect,
    parse_address,
)
from islands.runtime.launch.stop import StopAt
from islands.runtime.payload_auth import PayloadAuthError
from islands.runtime.world import close_world, elastic_device, join_elastic
from islands.sync.stack import Stack

__all__ = ["exit_now", "main", "parse_address", "run_elastic_worker"]


def run_elastic_worker(address: str, run_dir: Path, name: str, token: str, plot: bool = True) -> dict:
    """Join the job at `address` and train until it ends; returns the run record (`plot`: the one that writes
    run.json draws loss.png too)."""
    place = IslandPlace.from_env(os.environ.get(ISLAND_ENV))
    if place is None:
        _check_one_worker_islands(address, name, token)
    world = join_elastic(address, name, token, island=place)
    comm = world.membership
    assert isinstance(comm, (Membership, IslandFollower))  # what join_elastic gives a leader and a follower
    job = comm.job
    assert job is not None  # join_elastic read the job record before it returned
    if job.config is None:
        raise ValueError(
            f"the elastic job at {address} runs a script, not a config: start it with `islands join "
            f"{address}`, which runs the job's script"
        )
    cfg = from_mapping(job.config)
    cfg.world.probe = False  # the probe needs a fixed world
    # where this worker trains (the CPU unless the job says cuda); the cross-island Comm stays gloo and stages
    # device tensors through host memory (World.comm)
    world.device = elastic_device(cfg.world.device, place)
    if cfg.workers_per_island == 1:
        cfg.inner.strategy = "single"  # an island of one: nothing to average inside it
    leader = place is None or place.leader
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        # a joiner's strategy wrap (inside the Trainer) waits for a round boundary and receives the training state
        trainer = build_trainer(cfg, world, run_dir, plot=plot)
        if not leader:  # its leader writes the island's outer-exchange report
            writer = report_writer(trainer.strategy.outer if isinstance(trainer.strategy, Stack) else None)
            if writer is not None:
                writer.report_dir = None
        if trainer.checkpoints is not None:
            comm.before_join.append(lambda: trainer.checkpoints.settle(trainer))
        if cfg.checkpoint.resume and not world.start_step:  # a joiner starts from the members' state instead
            resume_trainer(trainer, cfg)
        trainer.add_callback(StopAt(comm.store, name))  # `islands stop`: every worker ends at the requested step
        record = trainer.fit(cfg.train.steps)
        if isinstance(comm, Membership):  # a leader, or a worker of a one-worker island
            _write_membership(run_dir, name, comm, global_digest(trainer.eval_model), place, world.shard)
        else:
            assert place is not None  # only a worker placed in a k-worker island follows
            _write_follower(run_dir, name, comm, global_digest(trainer.eval_model), place, world.shard)
        return record
    finally:
        close_world(world)


def _check_one_worker_islands(address: str, name: str, token: str) -> None:
    """`islands join` (no ISLANDS_ISLAND) starts one worker: refuse it in a job of k-worker islands before it
    is admitted (a wrong token still gets the coordinator's verdict)."""
    host, port = parse_address(address)
    refusal = JobSpec.read(connect(host, port), token, name=name).lone_joiner_refusal()
    if refusal:
        raise Refused(refusal)


def _island(place: IslandPlace | None) -> dict | None:
    return (
        None
        if place is None
        else {
            "index": place.index,
            "local": place.local,
            "size": place.size,
            "incarnation": place.incarnation,
            "leader": place.name(0),
        }
    )


def _write_membership(
    run_dir: Path,
    name: str,
    comm: Membership,
    digest: str,
    place: IslandPlace | None = None,
    data_shard: tuple[int, int] | None = None,
) -> None:
    out = run_dir / "elastic"
    out.mkdir(exist_ok=True)
    a = comm.admission
    assert a is not None  # join_elastic admitted it (Refused otherwise)
    session = comm.control_plane
    (out / f"{name}.json").write_text(
        json.dumps(
            {
                "name": name,
                "slot": a.slot,
                "shard": a.shard,
                "initial": a.initial,
                "island": _island(place),
                "data_shard": list(data_shard) if data_shard else None,  # (shard, shards) it trained on
                "global_sha256": digest,
                "final": comm.state_dict(),
                "syncs": comm.syncs,
                "control_plane": session.snapshot() if session is not None else None,
            },
            indent=1,
        )
    )
    if session is not None and session.store.accepted_digests is not None:  # ISLANDS_AUTH_AUDIT: experiments
        (out / f"{name}.audit").write_text(json.dumps(session.accepted_digests()))


def _write_follower(
    run_dir: Path, name: str, follower, digest: str, place: IslandPlace, data_shard: tuple[int, int]
) -> None:
    """A follower's record: its island, the global model's digest (equal to its leader's) and what it saw."""
    out = run_dir / "elastic"
    out.mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(
        json.dumps(
            {
                "name": name,
                "island": _island(place),
                "data_shard": list(data_shard),
                "global_sha256": digest,
                "final": follower.state_dict(),
            },
            indent=1,
        )
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(
            "usage: python -m islands.app.elastic_worker HOST:PORT RUN_DIR (ISLANDS_TOKEN in the environment)",
            file=sys.stderr,
        )
        return 2
    token = os.environ.get(TOKEN_ENV, "")
    name = os.environ.get(NAME_ENV) or f"j{secrets.token_hex(4)}"
    try:
        run_elastic_worker(argv[0], Path(argv[1]), name, token, plot=worker_plots())
    except Refused as e:
        print(f"islands: join refused by {argv[0]}: {e}", file=sys.stderr)
        return REFUSED_EXIT_CODE
    except (Excluded, IslandBroken, PayloadAuthError) as e:  # one line, exit 1: the others go on without it
        print(f"islands: {e}", file=sys.stderr)
        return 1
    except JobEnded as e:
        print(f"islands: {argv[0]}: {e}", file=sys.stderr)
        return JOB_ENDED_EXIT_CODE
    except Exception:  # noqa: BLE001 - the process's last frame: any other failure is a traceback and exit 1
        traceback.print_exc()
        return 1
    return 0


def exit_now(code: int) -> NoReturn:
    """Exit without finalisers: a retired gloo group with a hung op would hold exit until its timeout."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
