"""Peer replication of the in-memory level (SOTA-057) over real gloo ranks: the driver ships rank r's memory
checkpoint to rank (r+1) % n through the counted Comm, and a rank that lost its state gets it back."""

import datetime
import os
import socket
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.procs import forkserver
from islands.checkpoint.policy.driver import CheckpointDriver
from islands.checkpoint.policy.settings import CheckpointSettings
from islands.checkpoint.store.peer import KIND, PeerReplica
from islands.runtime.comm import Comm, CommLedger
from islands.runtime.world import World


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=30))


class FakeState:
    """A TrainingState (islands.checkpoint.policy.driver) whose weights are a function of rank and step."""

    shard_items = 10

    def __init__(self, world: World):
        self.world, self.rank, self.step, self.elapsed = world, world.rank, 0, 0.0
        self.model = torch.nn.Linear(2, 2)  # only asked whether it is sharded

    def weights(self, step: int) -> torch.Tensor:
        return torch.arange(50, dtype=torch.float32) * (self.rank + 1) + step

    def model_state_dict(self) -> dict:
        return {"w": self.weights(self.step)}

    def state_dict(self) -> dict:
        return {"step": self.step, "model": self.model_state_dict(), "rng": {"seed": self.rank}}

    def load_state_dict(self, tree: dict) -> None:
        self.step = int(tree["step"])

    def advance(self) -> None:
        self.step += 1
        self.elapsed += 0.01


def _driver_worker(rank: int, size: int, port: int, out: str) -> None:
    try:
        _init(rank, size, port)
        settings = CheckpointSettings(memory_every=2, memory_peer=True, timeout=30.0)
        world = World(rank=rank, size=size, islands=1, device=torch.device("cpu"), backend="gloo")
        driver = CheckpointDriver(settings, world, run_dir=out)
        trainer = FakeState(world)
        for _ in range(7):  # memory saves at 2, 4, 6; each replicated
            trainer.advance()
            driver.after_step(trainer)
        driver.writer.wait()
        held_step = driver.peer.held_step
        sent = world.ledger.sent.get(KIND, 0)
        rec = driver.record()
        # rank 1 is replaced: its memory and trainer state are gone; its successor still holds a copy
        restored = driver.restore_peer(lost=(rank == 1))
        ok = (
            restored is not None
            and restored.step == 6
            and restored.level == "memory-peer"
            and torch.equal(restored.tree["model"]["w"], trainer.weights(6))
            and restored.tree["rng"]["seed"] == rank
        )
        Path(f"{out}/rank{rank}.txt").write_text(
            f"{int(ok)} {held_step} {int(sent > 0)} {int(rec['memory_peer']['bytes_sent'] + 3 * 16 == sent)} "
            f"{rec['saves']['memory']} {rec['memory_skipped_busy']}"
        )
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the parent reads the rank's traceback from its file
        Path(f"{out}/rank{rank}.txt").write_text("error\n" + traceback.format_exc())


def test_driver_replicates_memory_level_to_the_next_rank_and_restores_a_lost_rank(tmp_path):
    mp.start_processes(_driver_worker, args=(2, _port(), str(tmp_path)), nprocs=2, join=True, start_method=forkserver())
    for rank in range(2):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert not text.startswith("error"), text
        ok, held, counted, matches, saves, skipped = text.split()
        assert ok == "1", f"rank {rank} did not get its step-6 state back from its peer"
        assert held == "6" and counted == "1" and matches == "1"  # payload + a 16-byte size header per save
        assert saves == "3" and skipped == "0"  # with a peer, memory saves never skip (all ranks in step)


def _ring_worker(rank: int, size: int, port: int, out: str) -> None:
    try:
        _init(rank, size, port)
        ledger = CommLedger()
        peer = PeerReplica(Comm(None, ledger))
        mine = bytes([rank]) * (100 + 10 * rank)  # different sizes per rank
        peer.replicate(5, mine)
        expect_pred = bytes([(rank - 1) % size]) * (100 + 10 * ((rank - 1) % size))
        assert peer.held == expect_pred and peer.held_step == 5
        if rank == 2:
            peer.forget()  # rank 2 lost its memory: rank 1's copy is gone, so rank 1 recovers nothing
        back, step = peer.recover()
        if rank == 1:
            assert back is None and step is None
        else:
            assert back == mine and step == 5
        assert ledger.sent[KIND] == len(mine) + 16 + (len(expect_pred) if rank != 2 else 0) + 16
        Path(f"{out}/rank{rank}.txt").write_text("ok")
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the parent reads the rank's traceback from its file
        Path(f"{out}/rank{rank}.txt").write_text("error\n" + traceback.format_exc())


@pytest.mark.slow  # three spawned ranks: ~20 s on 2 shared cores
def test_ring_of_three_holds_the_predecessor_and_counts_every_byte(tmp_path):
    mp.start_processes(_ring_worker, args=(3, _port(), str(tmp_path)), nprocs=3, join=True, start_method=forkserver())
    for rank in range(3):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "ok", (tmp_path / f"rank{rank}.txt").read_text()
