"""One elastic worker: ask to join, enter an epoch, train with an ElasticComm, leave.

    python -m islands.runtime.elastic_worker HOST:PORT RUN_DIR
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

from islands.config import TrainConfig, from_mapping
from islands.runtime.comm import CommLedger
from islands.runtime.elastic import ElasticComm, Excluded
from islands.runtime.membership import REFUSED_EXIT_CODE, Heartbeat, Refused, ask_to_join, connect
from islands.runtime.world import World

# Outer strategies whose exchanges are in flight across steps: a join needs a quiet round boundary.
_IN_FLIGHT = ("overlap-local-sgd", "streaming-diloco")


def check_elastic_config(cfg: TrainConfig) -> None:
    """Elastic mode is an outer strategy with one worker per island (inner single); say so otherwise."""
    if not cfg.outer:
        raise ValueError("elastic=true needs an outer strategy (e.g. outer='diloco:inner_steps=20'): members "
                         "meet only at its synchronisations")
    if cfg.islands != cfg.workers or cfg.inner not in ("auto", "single"):
        raise ValueError(f"elastic=true needs one worker per island (islands == workers, inner single); got "
                         f"workers={cfg.workers}, islands={cfg.islands}, inner={cfg.inner!r}")
    from islands.sync.outer import parse_outer

    spec = parse_outer(cfg.outer)
    if spec.name in _IN_FLIGHT or spec.params.get("tau", 0):
        raise ValueError(f"elastic=true needs an outer strategy without exchanges in flight across steps; "
                         f"{cfg.outer!r} overlaps them. Use local-sgd, post-local-sgd, slowmo, easgd or diloco (tau=0)")
    from islands.compress.optim import parse_optimizer

    if parse_optimizer(cfg.optimizer).communicates:
        raise ValueError(f"optimizer={cfg.optimizer!r} communicates inside an island; elastic mode has one "
                         "worker per island, use optimizer='adamw'")
    if cfg.testbed:
        raise ValueError("elastic=true does not run inside a testbed yet; leave testbed=''")
    if cfg.ckpt_policy:
        raise ValueError("elastic=true needs a fixed checkpoint interval (ckpt_every=N, ckpt_policy=''): the auto "
                         "policy's decisions come from history a worker joining later does not have")
    if cfg.ckpt_memory_peer:
        raise ValueError("elastic=true does not replicate the memory level to a peer (ring neighbours change "
                         "with membership); leave ckpt_memory_peer off, the local and remote levels still work")
    if cfg.heartbeat_timeout <= 0:
        raise ValueError(f"heartbeat_timeout must be > 0 seconds; got {cfg.heartbeat_timeout}")


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address must be HOST:PORT (e.g. 127.0.0.1:29500); got {text!r}")
    return host, int(port)


def elastic_world(cfg: TrainConfig, comm: ElasticComm, ledger: CommLedger, shard: int) -> World:
    from islands.sync.outer import LoneComm

    rank, size = (comm.rank, comm.size) if comm.members else (0, 1)  # a joiner builds before it enters
    world = World(rank=rank, size=size, islands=size, device=torch.device("cpu"), backend="gloo",
                  ledger=ledger, comms={"cross": comm, "global": comm, "local": LoneComm()},
                  data_shard=(shard, cfg.workers), membership=comm)

    def follow(rank: int, size: int) -> None:
        world.rank, world.size, world.islands = rank, size, size

    comm.on_change = follow
    return world


def run_elastic_worker(address: str, run_dir: Path, name: str, token: str, on_step=None) -> dict:
    """Join the job at `address` and train until it ends; returns the run record."""
    from islands.trainer import Trainer

    host, port = parse_address(address)
    store = connect(host, port)
    admission = ask_to_join(store, name, token)
    cfg = from_mapping(json.loads(store.get("config")))
    cfg.inner, cfg.probe = "single", False  # one worker per island; the probe needs a fixed world
    beat = Heartbeat(host, port, name)
    ledger = CommLedger()
    comm = ElasticComm(store, name, ledger, heartbeat_timeout=cfg.heartbeat_timeout, collective_timeout=cfg.timeout,
                       new_client=lambda: connect(host, port))
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        if admission.initial:
            comm.form(0, None)
            trainer = Trainer(cfg, elastic_world(cfg, comm, ledger, admission.shard), run_dir)
            if cfg.resume:
                from islands.checkpoint.resume import resume_trainer

                resume_trainer(trainer, cfg.resume)
        else:
            trainer = comm.enter_as_joiner(lambda: Trainer(cfg, elastic_world(cfg, comm, ledger, admission.shard),
                                                           run_dir))

        def hook(t):
            comm.on_step(t)
            if on_step is not None:
                on_step(t)

        record = trainer.run(on_step=hook)
        _write_membership(run_dir, name, admission, comm, global_digest(trainer))
        return record
    finally:
        beat.stop()
        comm.leave()


def global_digest(trainer) -> str:
    """SHA-256 of the global model's parameters: survivors must agree on it bit for bit."""
    import hashlib

    h = hashlib.sha256()
    for t in trainer.strategy.eval_model(trainer.model).state_dict().values():
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _write_membership(run_dir: Path, name: str, admission, comm: ElasticComm, digest: str) -> None:
    out = run_dir / "elastic"
    out.mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({
        "name": name, "slot": admission.slot, "shard": admission.shard, "initial": admission.initial,
        "global_sha256": digest, "final": comm.state_dict(), "syncs": comm.syncs}, indent=1))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m islands.runtime.elastic_worker HOST:PORT RUN_DIR (ISLANDS_TOKEN in the environment)",
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
