"""One elastic worker: ask to join, enter an epoch, train with an ElasticComm, leave.

    python -m islands.app.elastic_worker HOST:PORT RUN_DIR
with ISLANDS_TOKEN (the job's secret) and ISLANDS_NAME (this process's name) in the environment.
The launcher starts the first cfg.workers this way; `islands join` starts later ones the same way.
A refused process logs one line and exits with code 3 (membership.REFUSED_EXIT_CODE).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import traceback
from pathlib import Path

import torch

from islands.app.build import build_trainer, resume_trainer
from islands.config import JobConfig, from_mapping
from islands.runtime.comm import CommLedger
from islands.runtime.elastic import ElasticComm, Excluded, global_digest
from islands.runtime.membership import REFUSED_EXIT_CODE, Heartbeat, Refused, ask_to_join, connect
from islands.runtime.world import World
from islands.sync.outer import LoneComm


class ElasticSteps:
    """The loop's callback of an elastic member: after each step, joins at round boundaries (ElasticComm.on_step),
    before the step's checkpoint (a joiner must not be in a save's barrier without being in the loop)."""

    order = 15

    def __init__(self, comm: ElasticComm, on_step=None):
        self.comm, self.on_step = comm, on_step

    def on_step_end(self, trainer, loss: float) -> None:
        self.comm.on_step(trainer)
        if self.on_step is not None:
            self.on_step(trainer)

def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address must be HOST:PORT (e.g. 127.0.0.1:29500); got {text!r}")
    return host, int(port)


def elastic_world(cfg: JobConfig, comm: ElasticComm, ledger: CommLedger, shard: int) -> World:
    rank, size = (comm.rank, comm.size) if comm.members else (0, 1)  # a joiner builds before it enters
    world = World(rank=rank, size=size, islands=size, device=torch.device("cpu"), backend="gloo",
                  ledger=ledger, comms={"cross": comm, "global": comm, "local": LoneComm()},
                  data_shard=(shard, cfg.world.workers), membership=comm)

    def follow(rank: int, size: int) -> None:
        world.rank, world.size, world.islands = rank, size, size

    comm.on_change = follow
    return world


def run_elastic_worker(address: str, run_dir: Path, name: str, token: str, on_step=None) -> dict:
    """Join the job at `address` and train until it ends; returns the run record."""
    host, port = parse_address(address)
    store = connect(host, port)
    admission = ask_to_join(store, name, token)
    cfg = from_mapping(json.loads(store.get("config")))
    cfg.inner.strategy, cfg.world.probe = "single", False  # one worker per island; the probe needs a fixed world
    beat = Heartbeat(host, port, name)
    ledger = CommLedger()
    comm = ElasticComm(store, name, ledger, heartbeat_timeout=cfg.elastic.heartbeat_timeout,
                       collective_timeout=cfg.world.timeout, new_client=lambda: connect(host, port))
    steps = ElasticSteps(comm, on_step)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        def make():
            return build_trainer(cfg, elastic_world(cfg, comm, ledger, admission.shard), run_dir, callbacks=[steps])

        if admission.initial:
            comm.form(0, None)
            trainer = make()
            if cfg.checkpoint.resume:
                resume_trainer(trainer, cfg)
        else:
            trainer = comm.enter_as_joiner(make)
        record = trainer.fit(cfg.train.steps)
        _write_membership(run_dir, name, admission, comm, global_digest(trainer.eval_model))
        return record
    finally:
        beat.stop()
        comm.leave()


def _write_membership(run_dir: Path, name: str, admission, comm: ElasticComm, digest: str) -> None:
    out = run_dir / "elastic"
    out.mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({
        "name": name, "slot": admission.slot, "shard": admission.shard, "initial": admission.initial,
        "global_sha256": digest, "final": comm.state_dict(), "syncs": comm.syncs}, indent=1))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m islands.app.elastic_worker HOST:PORT RUN_DIR (ISLANDS_TOKEN in the environment)",
              file=sys.stderr)
        return 2
    token = os.environ.get("ISLANDS_TOKEN", "")
    name = os.environ.get("ISLANDS_NAME") or f"j{secrets.token_hex(4)}"
    try:
        run_elastic_worker(argv[0], Path(argv[1]), name, token)
    except Refused as e:
        print(f"islands: join refused by {argv[0]}: {e}", file=sys.stderr)
        return REFUSED_EXIT_CODE
    except Excluded as e:
        print(f"islands: {e}", file=sys.stderr)
        return 1
    except Exception:
        traceback.print_exc()
        return 1
    return 0


def exit_now(code: int) -> None:
    """Exit without finalisers: a retired gloo group with a hung op would hold exit until its timeout."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
