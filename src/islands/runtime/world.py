"""The world a worker lives in: ranks, the island x local mesh, and the process groups over it.

Rank layout: global rank r lives on island r // workers_per_island, local index r % workers_per_island.
`local` groups join the ranks of one island (inner strategy, every step); `cross` groups join the
ranks holding the same local index on every island (outer strategy, rarely). One island and one
worker per island are ordinary cases of the same layout.

An elastic job (`islands run --elastic`, `islands train --elastic`; docs/membership.md) has one worker
per island and no torch process group: its cross-island Comm is an ElasticComm whose members change
when workers die or join, and `rank`, `size` and `islands` follow the members.
"""

from __future__ import annotations

import datetime as _dt
import os
import secrets
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from islands.runtime.comm import Comm, CommLedger
from islands.runtime.elastic import ElasticComm, Excluded, JobEnded
from islands.runtime.membership import ELASTIC_ENV, NAME_ENV, TOKEN_ENV, Heartbeat, Refused, join_job, parse_address


class LoneComm:
    """The Comm of a scope with one member and no process group: every collective is identity."""

    size, rank = 1, 0

    def all_reduce(self, tensor, op=None, kind: str = "all_reduce"):
        return tensor

    def all_gather(self, tensor, kind: str = "all_gather"):
        return [tensor]

    def broadcast(self, tensor, src: int = 0, kind: str = "broadcast"):
        return tensor


@dataclass
class World:
    rank: int
    size: int
    islands: int
    device: torch.device
    backend: str
    ledger: CommLedger = field(default_factory=CommLedger)
    mesh: object | None = None  # torch.distributed.device_mesh.DeviceMesh when size > 1
    local_group: object | None = None
    cross_group: object | None = None
    # elastic mode (islands.runtime.elastic): its own Comm per scope, a fixed data shard
    # (shard, shards) that survives rank changes, and the membership whose state is checkpointed
    comms: dict | None = None
    data_shard: tuple[int, int] | None = None
    membership: object | None = None
    owns_group: bool = False  # init_world made the default process group (close_world destroys only that)
    # The step this process's loop starts at: for a joiner of an elastic job, the members' step when it entered
    # (its strategy's wrap received their global model and strategy state); 0 otherwise.
    start_step: int = 0

    @property
    def workers_per_island(self) -> int:
        return self.size // self.islands

    @property
    def island(self) -> int:
        return self.rank // self.workers_per_island

    @property
    def local_rank(self) -> int:
        return self.rank % self.workers_per_island

    @property
    def shard(self) -> tuple[int, int]:
        """(index, count) of this rank's data shard: its rank, or the fixed shard of an elastic worker."""
        return self.data_shard or (self.rank, self.size)

    @property
    def distributed(self) -> bool:
        return self.size > 1 or self.membership is not None  # an elastic world of one may grow

    def comm(self, scope: str = "global") -> Comm:
        """Counted collectives over 'global', 'local' (this island) or 'cross' (same slot, all islands)."""
        if self.comms and scope in self.comms:
            return self.comms[scope]
        group = {"global": None, "local": self.local_group, "cross": self.cross_group}[scope]
        return Comm(group, self.ledger)

    def all_gather_object(self, obj) -> list:
        """Bookkeeping gather over every rank (not training traffic)."""
        gather = getattr(self.comm("global"), "all_gather_object", None)
        if gather is not None:
            return gather(obj)
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    @staticmethod
    def single(device: str | torch.device = "cpu") -> "World":
        return World(rank=0, size=1, islands=1, device=torch.device(device), backend="none")


def pick_backend(device: str = "auto") -> tuple[str, torch.device]:
    """(backend, device) for this process: NCCL on its own GPU, or gloo on the CPU.

    NCCL refuses two ranks on one GPU, so "auto" takes CUDA only when every worker on this host
    (LOCAL_WORLD_SIZE, set by our launcher and by torchrun) gets its own device.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda; got {device!r}")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_workers = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and local_workers > gpus:
        raise ValueError(f"device=cuda needs one GPU per worker on this host: {local_workers} worker(s), "
                         f"{gpus} GPU(s) visible; use device=cpu (gloo) or at most {gpus} worker(s) per host")
    if device == "cpu" or local_workers > gpus:
        return "gloo", torch.device("cpu")
    torch.cuda.set_device(local)
    return "nccl", torch.device("cuda", local)


ISLANDS_ENV = "ISLANDS_ISLANDS"  # set by `islands run --islands K` for scripts that do not say


def init_world(islands: int | None = None, timeout_s: float = 120.0, device: str = "auto") -> World:
    """The World of this process: join the job described by torch's env:// variables (set by `islands run`,
    `islands train`'s launcher or torchrun), or take over a default process group the script already made.

    `islands`: how many islands the ranks form (None: $ISLANDS_ISLANDS, else 1). Without a distributed
    environment it is a world of one process. An existing default process group is reused as it is (its
    backend and timeout are the script's); `timeout_s` and `device` apply to a group made here.

    Under `islands run --elastic` (ISLANDS_ELASTIC set) it joins the elastic job instead (join_elastic): one
    worker per island, so `islands` is not used, and the job's own collective timeout applies. A process the
    job refuses, or a joiner the job ended before admitting, prints why and exits with code 3 or 4.
    """
    if islands is None:
        islands = int(os.environ.get(ISLANDS_ENV, "1"))
    if islands < 1:
        raise ValueError(f"islands must be >= 1, got {islands}")
    address = os.environ.get(ELASTIC_ENV, "")
    if address:
        if device == "cuda":
            raise ValueError("an elastic job exchanges over gloo on the CPU; use device='cpu' or 'auto'")
        sys.excepthook = _elastic_exit(address, sys.excepthook)
        return join_elastic(address, os.environ.get(NAME_ENV) or f"j{secrets.token_hex(4)}",
                            os.environ.get(TOKEN_ENV, ""))
    if dist.is_available() and dist.is_initialized():  # the script made its own: use it, never make a second
        backend = dist.get_backend()
        dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        return _world_over_default_group(islands, dev, backend)
    if "RANK" not in os.environ:
        if islands != 1:
            raise ValueError(f"islands={islands} needs several processes: start the script with "
                             f"`islands run --workers N` or torchrun; a single process is one island")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device=cuda but no CUDA device is visible; use device=cpu or auto")
        return World.single("cpu" if device == "cpu" or not torch.cuda.is_available() else "cuda")
    backend, dev = pick_backend(device)
    dist.init_process_group(backend=backend, init_method="env://", timeout=_dt.timedelta(seconds=timeout_s))
    world = _world_over_default_group(islands, dev, backend)
    world.owns_group = True
    return world


def _world_over_default_group(islands: int, device: torch.device, backend: str) -> World:
    rank, size = dist.get_rank(), dist.get_world_size()
    if size % islands:
        raise ValueError(f"world size {size} is not divisible by islands={islands}; choose a divisor of {size}")
    world = World(rank=rank, size=size, islands=islands, device=device, backend=backend)
    if size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        world.mesh = init_device_mesh(device.type, (islands, size // islands), mesh_dim_names=("island", "local"))
        world.local_group = world.mesh.get_group("local")
        world.cross_group = world.mesh.get_group("island")
    return world


def close_world(world: World) -> None:
    """Leave the job: destroy the default process group if init_world made it (a script's own stays); an
    elastic member stops its heartbeat and tells the others it finished."""
    membership = world.membership
    if membership is not None:
        membership.leave()
        if membership.holder is None and sys.exc_info()[0] is None:  # not while an error propagates (finally:)
            print(f"islands: warning: {membership.name} ran without an outer strategy holding the job's membership "
                  f"(an inner strategy alone does not), so it exchanged nothing with the others; {NO_OUTER}",
                  file=sys.stderr, flush=True)
    if world.owns_group and dist.is_initialized():
        dist.destroy_process_group()


# ---- elastic jobs -------------------------------------------------------------------------------------
NO_OUTER = ("an elastic job needs an outer strategy: wrap the model with one, e.g. islands.Stack(outer="
            "islands.outer.DiLoCo(inner_steps=50)); its members exchange only at its round boundaries, and "
            "joiners enter there (without one every worker trains alone)")


def join_elastic(address: str, name: str, token: str) -> World:
    """Join the elastic job whose store is at HOST:PORT as `name`: prove the token, start the heartbeat, and
    return the World over an ElasticComm. A first member (one of the job's first `workers`) is in epoch 0
    at once; a later one enters at a round boundary, in the wrap of its strategy (ElasticComm.enter).

    Raises Refused (wrong token, name taken) before anything else starts."""
    host, port = parse_address(address)
    session = join_job(host, port, name, token)  # every store value after the handshake is authenticated
    admission, job = session.admission, session.job
    comm = ElasticComm(session.store, name, CommLedger(), heartbeat_timeout=job.heartbeat_timeout,
                       collective_timeout=job.timeout, new_client=session.new_client)
    comm.admission, comm.job = admission, job
    comm.control_plane = session  # its AuthStores' counts of accepted and refused values (run records)
    comm.heartbeat = Heartbeat(host, port, name, auth=session.auth, new_client=session.new_client)
    world = elastic_world(comm, (admission.shard, job.workers))
    if admission.initial:
        comm.form(0, None)
    return world


def elastic_world(comm: ElasticComm, data_shard: tuple[int, int]) -> World:
    """The World of an elastic member: every scope but "local" (an island of one) is the ElasticComm; rank,
    size and islands follow its members; `data_shard` (shard, shards) stays whoever else comes and goes."""
    rank, size = (comm.rank, comm.size) if comm.members else (0, 1)  # a joiner builds before it enters
    world = World(rank=rank, size=size, islands=size, device=torch.device("cpu"), backend="gloo",
                  ledger=comm.ledger, comms={"cross": comm, "global": comm, "local": LoneComm()},
                  data_shard=data_shard, membership=comm)

    def follow(rank: int, size: int) -> None:
        world.rank, world.size, world.islands = rank, size, size

    comm.on_change = follow
    return world


def _elastic_exit(address: str, previous):
    """An excepthook: a process the job refused, ended before admitting, or dropped prints one line and exits
    with the code `islands join` documents (3, 4, 1), not a traceback. Finalisers are skipped: a retired
    gloo group whose peer hung could hold the exit until its timeout."""
    def hook(kind, value, tb):
        if isinstance(value, Refused):
            line = f"join refused by {address}: {value}"
        elif isinstance(value, JobEnded):
            line = f"{address}: {value}"
        elif isinstance(value, Excluded):
            line = str(value)
        else:
            return previous(kind, value, tb)
        print(f"islands: {line}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(value.exit_code)

    return hook
