"""The world a worker lives in: ranks, the island x local mesh, and the process groups over it.

Rank layout: global rank r lives on island r // workers_per_island, local index r % workers_per_island.
`local` groups join the ranks of one island (inner strategy, every step); `cross` groups join the
ranks holding the same local index on every island (outer strategy, rarely). One island and one
worker per island are ordinary cases of the same layout.

An elastic job (`islands run --elastic`, `islands train --elastic`; docs/membership.md) has no torch
process group across islands: its cross-island Comm is an ElasticComm whose members change when islands
die or join (`world.membership`: the Membership of islands.runtime.elastic that forms the epochs and admits
joiners), and `rank`, `size` and `islands` follow the members. Islands of one worker are members themselves;
in islands of k workers (`islands train --elastic`, islands.runtime.elastic.island_comm) the leader is the member, the
island's workers share a local gloo group (their default process group), and every worker's cross-island Comm
is an IslandComm that relays the leader's results.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import os
import secrets
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from islands.runtime import stacks
from islands.runtime.comm import Comm, CommLedger
from islands.runtime.contracts import Collectives, ElasticMembership
from islands.runtime.cross import CrossIslands, CrossSpec, cross_requested, exit_line
from islands.runtime.elastic import Excluded, JobEnded, Membership, elastic_member
from islands.runtime.elastic.auth import ControlAuth
from islands.runtime.elastic.island_comm import (
    ISLAND_ENV,
    IslandBroken,
    IslandComm,
    IslandFollower,
    IslandLeader,
    IslandPlace,
    local_timeout,
)
from islands.runtime.elastic.membership import (
    ELASTIC_ENV,
    NAME_ENV,
    TOKEN_ENV,
    Heartbeat,
    JobSpec,
    Liveness,
    Refused,
    authed,
    connect,
    join_job,
    parse_address,
)
from islands.runtime.payload_auth import PayloadAuthError
from islands.runtime.staging import HostBuffers, StagedComm, StagedElasticComm

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class LoneComm:
    """The Comm of a scope with one member and no process group: every collective is identity."""

    size, rank = 1, 0
    elastic = False
    epoch: int | None = None

    def all_reduce(self, tensor, op=None, kind: str = "all_reduce"):
        return tensor

    def all_gather(self, tensor, kind: str = "all_gather"):
        return [tensor]

    def broadcast(self, tensor, src: int = 0, kind: str = "broadcast"):
        return tensor

    def all_gather_object(self, obj) -> list:
        return [obj]


@dataclass
class World:
    rank: int
    size: int
    islands: int
    device: torch.device
    backend: str
    ledger: CommLedger = field(default_factory=CommLedger)
    mesh: object | None = None  # torch.distributed.device_mesh.DeviceMesh when size > 1
    local_group: ProcessGroup | None = None
    cross_group: ProcessGroup | None = None
    # the backend of the cross-island group: the world's own, or gloo for a GPU job whose islands meet over TCP
    # (resolve_cross_backend); device tensors then cross through host buffers (runtime.staging)
    cross_backend: str = ""
    # the backend of the island groups when they are made apart from the default group: "nccl" where islands share
    # GPUs (plan_groups; the default group and the cross groups are gloo); "" where they are the mesh's groups on
    # the world's own backend
    local_backend: str = ""
    # elastic mode (islands.runtime.elastic): its own Comm per scope, a fixed data shard
    # (shard, shards) that survives rank changes, and the membership whose state is checkpointed
    comms: dict | None = None
    data_shard: tuple[int, int] | None = None
    membership: ElasticMembership | None = None  # runtime.contracts; None in a fixed world
    owns_group: bool = False  # init_world made the default process group (close_world destroys only that)
    _host_buffers: HostBuffers = field(default_factory=HostBuffers, repr=False)
    # The step this process's loop starts at: for a joiner of an elastic job, the members' step when it entered
    # (its strategy's wrap received their global model and strategy state); 0 otherwise.
    start_step: int = 0

    @property
    def worker_names(self) -> list[str] | None:
        """Every worker of an elastic job in rank order, where they are not the members themselves (islands of k
        workers: IslandWorld); None otherwise (the members' names are the workers')."""
        return None

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

    def comm(self, scope: str = "global") -> Collectives:
        """Counted collectives over 'global', 'local' (this island) or 'cross' (same slot, all islands)."""
        comm = self.host_comm(scope)
        return self.across(comm) if scope == "cross" else comm

    def host_comm(self, scope: str = "global") -> Collectives:
        """comm(scope) without the host staging a GPU job's gloo cross group adds (wrappers that must see host
        tensors, such as payload authentication, wrap this one; comm() stages around them)."""
        if self.comms and scope in self.comms:
            return self.comms[scope]
        group = {"global": None, "local": self.local_group, "cross": self.cross_group}[scope]
        return Comm(group, self.ledger)

    @property
    def crosses_through_host(self) -> bool:
        """Whether this world's cross-island exchanges copy device tensors through host buffers (stages_across)."""
        return stages_across(self.device, self.cross_backend)

    def across(self, comm: Collectives) -> Collectives:
        """`comm` as this world's cross-island exchanges run: staged through host buffers where a device world
        crosses on gloo (crosses_through_host), else as it is."""
        if not self.crosses_through_host:
            return comm
        # one pool per process: every round reuses its buffers
        if comm.elastic:  # members change: the elastic surface (names, planned rounds) goes through too
            return StagedElasticComm(comm, self._host_buffers)
        return StagedComm(comm, self._host_buffers)

    def all_gather_object(self, obj) -> list:
        """Bookkeeping gather over every rank (not training traffic)."""
        return self.comm("global").all_gather_object(obj)

    def leave(self) -> None:
        """What this world holds beyond its process groups, let go at close_world (a joined island's heartbeat)."""

    @staticmethod
    def single(device: str | torch.device = "cpu") -> World:
        return World(rank=0, size=1, islands=1, device=torch.device(device), backend="none")


def check_device(device: str, needs_cuda: bool = False) -> None:
    """ValueError unless `device` is auto, cpu or cuda; with `needs_cuda`, also when cuda is asked and no CUDA
    device is visible."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda; got {device!r}")
    if needs_cuda and device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is visible; use device=cpu or auto")


@dataclass(frozen=True)
class GroupPlan:
    """Which backend each process group of a fixed world gets, and where this worker trains (plan_groups)."""

    backend: str  # the default group over every rank (bookkeeping gathers, the interconnect probe)
    local: str  # each island's group: the inner strategy's traffic, every step
    cross: str  # the groups of one slot on every island: the outer strategy's exchanges
    device: torch.device

    @property
    def shares_devices(self) -> bool:
        """Islands share GPUs: NCCL only inside each island, gloo for every group that spans islands."""
        return self.local != self.backend


def islands_may_share(islands: int, workers: int, gpus: int, cross_backend: str = "auto") -> bool:
    """Whether the islands of a fixed world may share this host's GPUs: more than one island, each of at most `gpus`
    workers (NCCL refuses two ranks of one group on one GPU, and an island's workers form one NCCL group), and
    nothing across islands on NCCL (cross_backend gloo, or auto, which then resolves to gloo)."""
    return (
        islands > 1 and workers % islands == 0 and 0 < workers // islands <= gpus and cross_backend in ("auto", "gloo")
    )


def plan_groups(
    device: str,
    cross_backend: str,
    islands: int,
    workers: int,
    local_workers: int,
    local_index: int,
    gpus: int,
    gloo_links: bool = False,
) -> GroupPlan:
    """The process groups and device of one worker of a fixed world, from the facts of its host: `workers` in the
    world, `local_workers` on this host (this one the `local_index`-th), `gpus` visible.

    - every worker on this host has a GPU of its own (device auto or cuda): NCCL for the default and island groups,
      and across islands what resolve_cross_backend says (NCCL, or gloo when asked or over testbed links);
    - device cpu, or auto with more workers than GPUs: gloo everywhere on the CPU;
    - device cuda with more workers than GPUs: the islands share the GPUs where islands_may_share allows it. Each
      island's workers get a NCCL group of their own (worker i of the host on GPU i modulo the GPUs: an island's
      workers hold consecutive ranks, so they land on different GPUs), and everything that spans islands, the
      default group and the cross groups, is gloo (device tensors cross through host buffers, runtime.staging),
      since NCCL refuses two ranks of one group on one GPU. Otherwise a ValueError says why.
    """
    check_device(device)
    check_cross_backend(cross_backend)
    local_workers = max(local_workers, local_index + 1)  # a worker's own index says at least this many share the host
    cpu = torch.device("cpu")
    if device == "cpu" or (device == "auto" and local_workers > gpus):
        return GroupPlan("gloo", "gloo", resolve_cross_backend(cross_backend, "gloo", gloo_links), cpu)
    if local_workers <= gpus:
        cross = resolve_cross_backend(cross_backend, "nccl", gloo_links)
        return GroupPlan("nccl", "nccl", cross, torch.device("cuda", local_index))
    if islands_may_share(islands, workers, gpus, cross_backend):
        return GroupPlan("gloo", "nccl", "gloo", torch.device("cuda", local_index % gpus))
    share = ""
    if gpus:
        share = (
            f", or let islands share the GPUs: islands > 1 of at most {gpus} worker(s) each, with cross_backend gloo "
            f"or auto (this job: {islands} island(s) of {workers // max(islands, 1)}, cross_backend {cross_backend})"
        )
    raise ValueError(
        f"device=cuda needs one GPU per worker on this host: {local_workers} worker(s), {gpus} GPU(s) visible; use "
        f"device=cpu (gloo) or at most {gpus} worker(s) per host{share}"
    )


def host_facts() -> tuple[int, int, int]:
    """(workers in the job, workers on this host, this worker's index among them) from torch's env:// variables. A
    job started by hand without LOCAL_WORLD_SIZE counts as one host: WORLD_SIZE workers, this one's index
    LOCAL_RANK (else RANK)."""
    env = os.environ
    workers = int(env.get("WORLD_SIZE", "1"))
    if "LOCAL_WORLD_SIZE" in env:
        return workers, int(env["LOCAL_WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))
    return workers, workers, int(env.get("LOCAL_RANK", env.get("RANK", "0")))


def plan_world(
    device: str = "auto", islands: int = 1, cross_backend: str = "auto", gloo_links: bool = False
) -> GroupPlan:
    """plan_groups for this process (host_facts, the GPUs torch sees), with its CUDA device made current."""
    workers, local_workers, local = host_facts()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    plan = plan_groups(device, cross_backend, islands, workers, local_workers, local, gpus, gloo_links)
    if plan.device.type == "cuda":
        torch.cuda.set_device(plan.device)
    return plan


def pick_backend(device: str = "auto") -> tuple[str, torch.device]:
    """(backend, device) for this process: NCCL on its own GPU, or gloo on the CPU.

    NCCL refuses two ranks on one GPU, so "auto" takes CUDA only when every worker on this host
    (LOCAL_WORLD_SIZE, set by our launcher and by torchrun) gets its own device. A job started by hand
    without LOCAL_WORLD_SIZE counts as one host: WORLD_SIZE workers, this one's index LOCAL_RANK (else RANK).
    The world of one island (plan_world: islands that share GPUs are init_world's).
    """
    plan = plan_world(device)
    return plan.backend, plan.device


ISLANDS_ENV = "ISLANDS_ISLANDS"  # set by `islands run --islands K` for scripts that do not say


def init_world(
    islands: int | None = None,
    timeout_s: float = 120.0,
    device: str = "auto",
    cross_backend: str = "auto",
    gloo_links: bool = False,
) -> World:
    """The World of this process: join the job described by torch's env:// variables (set by `islands run`,
    `islands train`'s launcher or torchrun), or take over a default process group the script already made.

    `islands`: how many islands the ranks form (None: $ISLANDS_ISLANDS, else 1). Without a distributed
    environment it is a world of one process. An existing default process group is reused as it is (its
    backend and timeout are the script's); `timeout_s` and `device` apply to a group made here.

    In a job of islands that are separate jobs (ISLANDS_CROSS_ADDR set: `islands run --separate-jobs`, or a
    torchrun per island; islands.runtime.cross) it returns join_islands(): the islands are the jobs, so `islands`
    is not used. An island the others dropped as slow, or one that refused a payload failing its MAC, prints why
    and exits 1 (a restart rejoins it); ISLANDS_CROSS_* settings that cannot work, or a token the islands refuse,
    print why and exit 2 or 3 (islands.runtime.cross.exit_line).

    Under `islands run --elastic` (ISLANDS_ELASTIC set) it joins the elastic job instead (join_elastic): its
    island is where the launcher put it (ISLANDS_ISLAND; one worker per island without it), so `islands` is
    not used, and the job's own collective timeout applies. A process the job refuses, or a joiner the job
    ended before admitting, prints why and exits with code 3 or 4; a worker whose island lost a worker (or
    that the members excluded) prints why and exits 1.

    `cross_backend` (auto | gloo | nccl): the backend of the cross-island groups of a fixed world
    (resolve_cross_backend; `gloo_links`: the islands meet over shaped or unreliable links, so auto takes gloo
    in a GPU job). Elastic and joined jobs always exchange over gloo.
    """
    check_cross_backend(cross_backend)
    if islands is None:
        islands = int(os.environ.get(ISLANDS_ENV, "1"))
    if islands < 1:
        raise ValueError(f"islands must be >= 1, got {islands}")
    address = os.environ.get(ELASTIC_ENV, "")
    if address or "RANK" in os.environ or (dist.is_available() and dist.is_initialized()):
        _hand_off_at_exit()
    if address:
        if cross_backend == "nccl":
            raise ValueError("an elastic job exchanges over gloo (NCCL cannot follow members that come and go)")
        sys.excepthook = _elastic_exit(address, sys.excepthook)
        island = IslandPlace.from_env(os.environ.get(ISLAND_ENV))
        return join_elastic(
            address,
            os.environ.get(NAME_ENV) or f"j{secrets.token_hex(4)}",
            os.environ.get(TOKEN_ENV, ""),
            island=island,
            device=elastic_device(device, island),
        )
    if cross_requested():  # an island of a joined job (ISLANDS_CROSS_ADDR): its own job inside, islands across
        if cross_backend == "nccl":
            raise ValueError("islands that are separate jobs meet over gloo (their own store); use cross_backend=auto")
        # before joining: settings or a token the islands refuse end with their one line too
        sys.excepthook = _one_line_exit(exit_line, sys.excepthook)
        return join_islands(timeout_s=timeout_s, device=device)
    if dist.is_available() and dist.is_initialized():  # the script made its own: use it, never make a second
        backend: str = dist.get_backend()  # a torch Backend, a str
        dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        return _world_over_default_group(islands, dev, backend, cross_backend, gloo_links, timeout_s)
    if "RANK" not in os.environ:
        if islands != 1:
            raise ValueError(
                f"islands={islands} needs several processes: start the script with "
                f"`islands run --workers N` or torchrun; a single process is one island"
            )
        check_device(device, needs_cuda=True)
        return World.single("cpu" if device == "cpu" or not torch.cuda.is_available() else "cuda")
    plan = plan_world(device, islands, cross_backend, gloo_links)
    init_default_group(plan.backend, timeout_s)
    world = _world_over_default_group(
        islands,
        plan.device,
        plan.backend,
        cross_backend,
        gloo_links,
        timeout_s,
        island_backend=plan.local if plan.shares_devices else None,
    )
    world.owns_group = True
    return world


def init_default_group(backend: str, timeout_s: float) -> None:
    """The default process group, from torch's env:// variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    Under a torch elastic agent that hands its own store to the workers (TORCHELASTIC_USE_AGENT_STORE=True: torchrun,
    `accelerate launch --multi_gpu`) every attempt of the worker group meets in that one store, and env:// adds no
    prefix per attempt. After a restart (--max-restarts) the keys of the attempt before are still there, so a
    restarted rank could read its peer's address of the dead attempt before the peer rewrote it and fail to connect
    (gloo: "connectFullMesh failed ... Connection refused"): a restarted island of several workers never came up.
    Here each attempt (TORCHELASTIC_RESTART_COUNT) meets under a prefix of its own."""
    timeout = _dt.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
        return
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"islands/attempt{attempt}", agent)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=size, timeout=timeout)


def framework_group_restart_hazard(env: dict[str, str], workers: int) -> str | None:
    """What to tell the user when a default group islands did not make (a Trainer's, Lightning's, an Accelerator's)
    belongs to an island that torch elastic may restart with several workers while sharing its agent's store
    (TORCHELASTIC_USE_AGENT_STORE=True, --max-restarts > 0): torch's env:// rendezvous then meets in the keys of
    the attempt before, and a restarted island failed or hung in 2 of 3 tries here with the Hugging Face Trainer
    (docs/frameworks.md). None where there is nothing to say."""
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if workers < 2 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not restarts.isdigit() or restarts == "0":
        return None
    return (
        f"islands: this island's {workers} workers may be restarted by torch elastic (--max-restarts {restarts}), "
        "but their process group was made by the framework in the launcher's shared store, where a restarted "
        "attempt can read the dead attempt's addresses and fail or hang; launch with "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment (torchrun --standalone or --rdzv-backend c10d) so "
        "that every attempt meets in a store of its own"
    )


def _world_over_default_group(
    islands: int,
    device: torch.device,
    backend: str,
    cross_backend: str = "auto",
    gloo_links: bool = False,
    timeout_s: float = 120.0,
    island_backend: str | None = None,
) -> World:
    """The World over the default process group. `island_backend`: each island's ranks get a group of their own on
    it, made apart from the default group, and the ("island", "local") mesh is built from the island and cross
    groups (islands sharing GPUs: NCCL inside each island over a gloo world, plan_groups); None: the mesh's groups
    on the world's own backend."""
    rank, size = dist.get_rank(), dist.get_world_size()
    if size % islands:
        raise ValueError(f"world size {size} is not divisible by islands={islands}; choose a divisor of {size}")
    cross = resolve_cross_backend(cross_backend, backend, gloo_links)
    world = World(rank=rank, size=size, islands=islands, device=device, backend=backend, cross_backend=cross)
    if size > 1 and island_backend is not None:
        from torch.distributed.device_mesh import DeviceMesh

        per_island, timeout = size // islands, _dt.timedelta(seconds=timeout_s)
        world.local_backend = island_backend
        world.local_group = island_groups(islands, per_island, island_backend, timeout)
        world.cross_group = cross_groups(islands, per_island, cross, timeout)
        assert world.local_group is not None and world.cross_group is not None  # every rank is in its own two
        world.mesh = DeviceMesh.from_group(
            [world.cross_group, world.local_group],
            device.type,
            mesh=torch.arange(size).view(islands, per_island),
            mesh_dim_names=("island", "local"),
        )
    elif size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        world.mesh = init_device_mesh(device.type, (islands, size // islands), mesh_dim_names=("island", "local"))
        world.local_group = world.mesh.get_group("local")
        if cross == backend and cross_backend != "gloo":
            world.cross_group = world.mesh.get_group("island")
        else:  # gloo across a NCCL world, or gloo named: a group of its own (a CPU job builds it as a GPU job does)
            world.cross_group = cross_groups(islands, size // islands, cross, _dt.timedelta(seconds=timeout_s))
    return world


CROSS_BACKENDS = ("auto", "gloo", "nccl")


def check_cross_backend(requested: str) -> None:
    if requested not in CROSS_BACKENDS:
        raise ValueError(f"cross_backend must be one of {', '.join(CROSS_BACKENDS)}; got {requested!r}")


def resolve_cross_backend(requested: str, backend: str, gloo_links: bool = False) -> str:
    """The backend of the cross-island group for `requested` (auto | gloo | nccl) in a world on `backend`.

    auto: the world's own backend, except gloo for a GPU job whose islands meet over links islands shapes or
    that may fail (`gloo_links`: a testbed; elastic jobs exchange over gloo anyway), where NCCL could hang on a
    dead peer instead of failing. gloo: always possible (device tensors are staged through host memory). nccl:
    only in a NCCL world."""
    check_cross_backend(requested)
    if requested == "nccl" and backend != "nccl":
        raise ValueError(
            f"cross_backend=nccl needs a CUDA world (device=cuda, one GPU per worker); this world runs {backend}: "
            "use cross_backend=gloo or auto"
        )
    if requested != "auto":
        return requested
    return "gloo" if backend == "nccl" and gloo_links else backend


def stages_across(device: torch.device, cross_backend: str) -> bool:
    """Whether cross-island tensors must be copied through host memory: a device world over a gloo cross group
    (a NCCL world crossing on gloo, or an elastic job on a GPU)."""
    return cross_backend == "gloo" and device.type != "cpu"


def island_groups(islands: int, per_island: int, backend: str, timeout: _dt.timedelta) -> ProcessGroup | None:
    """This rank's group of its own island's ranks, on `backend`. Collective, as cross_groups: every rank makes every
    island's group in the same order, and keeps its own."""
    me = dist.get_rank() // per_island
    mine = None
    for island in range(islands):
        ranks = list(range(island * per_island, (island + 1) * per_island))
        group = dist.new_group(ranks, backend=backend, timeout=timeout)
        if island == me:
            mine = group
    return mine


def cross_groups(islands: int, per_island: int, backend: str, timeout: _dt.timedelta) -> ProcessGroup | None:
    """This rank's group of the workers with its local index on every island, on `backend`. Collective: every
    rank makes every slot's group in the same order (torch's new_group), and keeps its own."""
    me = dist.get_rank() % per_island
    mine = None
    for slot in range(per_island):
        group = dist.new_group([i * per_island + slot for i in range(islands)], backend=backend, timeout=timeout)
        if slot == me:
            mine = group
    return mine


def close_world(world: World) -> None:
    """Leave the job: destroy the default process group if init_world made it (a script's own stays); an
    elastic member stops its heartbeat and tells the others it finished."""
    world.leave()
    membership = world.membership
    if membership is not None:
        membership.leave()
        if membership.holder is None and sys.exc_info()[0] is None:  # not while an error propagates (finally:)
            print(
                f"islands: warning: {membership.name} ran without an outer strategy holding the job's membership "
                f"(an inner strategy alone does not), so it exchanged nothing with the others; {NO_OUTER}",
                file=sys.stderr,
                flush=True,
            )
    if world.distributed:
        _let_collective_threads_finish()  # before the group can go: see GIL_HANDOFF_S
    if world.owns_group and dist.is_initialized():
        dist.destroy_process_group()
    if world.distributed:
        _let_collective_threads_finish()


# torch's gloo worker threads free a finished collective's tensors after the caller already has its result; freeing
# one that Python has dropped takes the GIL, and a thread still waiting for it when the interpreter exits aborts the
# process ("terminate called without an active exception"; torch PR 179291 describes it, unfixed in 2.13). And a
# group whose last owner is torch's DDP (its reducer outlives destroy_process_group when the user's model does) is
# destroyed with the GIL held, joining those threads: one still waiting for the GIL deadlocks the rank (seen in CI,
# a test rank stuck in ~ProcessGroupGloo under ~Reducer at its function's end). Giving the GIL up for a moment at
# close, before the group can go and again after, lets those threads finish while nothing waits on them.
GIL_HANDOFF_S = 0.05


def _let_collective_threads_finish() -> None:
    time.sleep(GIL_HANDOFF_S)


def _hand_off_at_exit() -> None:
    """The same hand-off for a script that never calls close_world, registered once per process."""
    global _exit_hand_off
    if not _exit_hand_off:
        _exit_hand_off = True
        atexit.register(_let_collective_threads_finish)


_exit_hand_off = False


# ---- islands that are separate jobs (islands.runtime.cross) -------------------------------------------
class JoinedWorld(World):
    """The World of one worker of an island that is a job of its own (islands.runtime.cross): "local" is the
    island's default process group (the one its framework's DDP uses), "cross" the elastic group of the workers
    with this one's local index on every island still alive. rank = island * k + local index, size = islands * k,
    both following the islands alive. No scope spans every worker of every island: "global" is refused."""

    cross: CrossIslands | None = None

    def comm(self, scope: str = "global") -> Collectives:
        if scope == "global":
            raise ValueError(
                "a joined job's islands share no group over every worker: use comm('cross') (worker j of every "
                "island) or comm('local') (this island)"
            )
        return super().comm(scope)

    def all_gather_object(self, obj) -> list:
        """Over the islands (worker j of each), not every worker: the one gather a joined job has."""
        return self.comm("cross").all_gather_object(obj)

    def follow(self, rank: int, size: int) -> None:
        """A new epoch of the cross group: this island is `rank` of `size` islands alive."""
        k = self.workers_per_island
        self.islands, self.size, self.rank = size, size * k, rank * k + self.local_rank

    @property
    def workers_per_island(self) -> int:
        return self.local_size

    @property
    def island(self) -> int:
        return self.rank // self.local_size

    @property
    def local_rank(self) -> int:
        return self.local_index

    local_size: int = 1
    local_index: int = 0

    def leave(self) -> None:
        cross, self.cross = self.cross, None  # once: close_world and the exit handler both call it
        if cross is not None:
            cross.leave()


def join_islands(spec: CrossSpec | None = None, timeout_s: float = 120.0, device: str = "auto") -> JoinedWorld:
    """This worker's World in a job of islands that are separate jobs (islands.runtime.cross; docs/frameworks.md):
    its island's default process group (the script's or its framework's when one exists, else made here from
    torch's env:// variables, as init_world makes it), and the cross-island group of its local index, formed over
    the store `spec` names (default: the ISLANDS_CROSS_* variables). Every island must have the same number of
    workers. Call it on every worker of every island after the framework made its group (a Trainer callback does)."""
    spec = CrossSpec.from_env() if spec is None else spec
    owns = False
    if dist.is_initialized():
        backend: str = dist.get_backend()
        dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        restart_hazard = framework_group_restart_hazard(dict(os.environ), dist.get_world_size())
        if restart_hazard:
            warnings.warn(restart_hazard, RuntimeWarning, stacklevel=2)
    elif "RANK" in os.environ:
        backend, dev = pick_backend(device)
        init_default_group(backend, timeout_s)
        owns = True
    else:  # an island of one process, started without a launcher
        backend, dev = "none", torch.device("cpu")
    _hand_off_at_exit()
    local, k = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    ledger = CommLedger()
    world = JoinedWorld(
        rank=spec.index * k + local,
        size=spec.islands * k,
        islands=spec.islands,
        device=dev,
        backend=backend,
        cross_backend="gloo",  # the cross store's elastic groups (islands.runtime.cross)
        ledger=ledger,
        owns_group=owns,
        # the shard this worker reads stays its own when islands die (their data is not taken over)
        data_shard=(spec.index * k + local, spec.islands * k),
    )
    world.local_size, world.local_index = k, local
    world.cross = CrossIslands(spec, local, ledger, on_change=world.follow, slots=k)
    # the outer strategy's wrap claims it: members admit restarted islands at round boundaries, and a restarted
    # island's workers enter there with the members' global model, outer state and step (islands.runtime.cross)
    world.membership = world.cross.membership
    # a script that never calls close_world (a Trainer's) still stops its heartbeat and says it finished before
    # the interpreter tears down (atexit runs this before the GIL hand-off registered above)
    atexit.register(world.leave)
    # world.ledger counts the traffic across islands only; the island's own (its framework's DDP, the island
    # buffer average) is the island's business and goes to a ledger of its own
    world.comms = {"cross": world.cross.comm, "local": Comm(None, CommLedger()) if k > 1 else LoneComm()}
    return world


# ---- elastic jobs -------------------------------------------------------------------------------------
NO_OUTER = (
    "an elastic job needs an outer strategy: wrap the model with one, e.g. islands.Stack(outer="
    "islands.outer.DiLoCo(inner_steps=50)); its members exchange only at its round boundaries, and "
    "joiners enter there (without one every worker trains alone)"
)


def elastic_device(device: str, island: IslandPlace | None = None) -> torch.device:
    """Where an elastic worker trains. auto and cpu: the CPU (an elastic job's islands may share one machine's
    GPUs in any number, so auto does not guess). cuda: GPU LOCAL_RANK modulo the GPUs visible (device 0
    without LOCAL_RANK); its cross-island exchanges stay gloo, through host buffers (runtime.staging). Only
    islands of one worker: an island of several meets over a gloo group of its own inside (island_comm), which
    this version keeps on the CPU."""
    check_device(device, needs_cuda=True)
    if device != "cuda":
        return torch.device("cpu")
    if island is not None and island.size > 1:
        raise ValueError(
            f"an elastic island of {island.size} workers trains on the CPU in this version (its workers meet over "
            "gloo inside the island); use islands of one worker on GPUs, or device=cpu"
        )
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def join_elastic(
    address: str,
    name: str,
    token: str,
    island: IslandPlace | None = None,
    device: torch.device | None = None,
) -> World:
    """Join the elastic job whose store is at HOST:PORT as `name`: prove the token, start the heartbeat, and
    return the World over its Membership (elastic_member) and ElasticComm. A first member (one of the job's first
    `workers`) is in epoch 0 at once; a later one enters at a round boundary, in the wrap of its strategy
    (Membership.enter).

    `island`: where the launcher put this process in an island of several workers (ISLANDS_ISLAND): its
    leader joins as above, a follower only reads the job and joins its island's local group
    (island_world). The data shard is then the island's own, `index * size + local` of `workers * size`, so
    a restarted island trains on the data of the one it replaces.

    `device`: where this worker trains (elastic_device; default the CPU); the exchanges across islands are
    gloo whatever it is, device tensors staged through host memory.

    Raises Refused (wrong token, name taken) before anything else starts."""
    host, port = parse_address(address)
    stacks.enable()  # a launcher that finds it silent asks for its threads' stacks before the kill
    if island is not None and not island.leader:
        return _follow_island(host, port, name, token, island)
    session = join_job(host, port, name, token)  # every store value after the handshake is authenticated
    admission, job = session.admission, session.job
    several = island is not None and island.size > 1
    member = elastic_member(
        session.store,
        name,
        CommLedger(),
        heartbeat_timeout=job.heartbeat_timeout,
        collective_timeout=job.timeout,
        new_client=session.new_client,
        membership=IslandLeader if several else Membership,
    )
    member.admission, member.job = admission, job
    member.control_plane = session  # its AuthStores' counts of accepted and refused values (run records)
    member.heartbeat = Heartbeat(host, port, name, auth=session.auth, new_client=session.new_client)
    if island is None:
        shard = (admission.shard, job.workers)
    else:  # the island's own shard, whatever admission order a restart has
        shard = (island.index * island.size + island.local, job.workers * island.size)
    if not several:
        world = elastic_world(member, shard, device or torch.device("cpu"))
        if admission.initial:
            member.epochs.form(0, None)
        return world
    assert island is not None  # `several` says there is one
    side = _island_group(session.store, island, job)
    relay = member.join_island(island, side=side)
    member.watch_followers()  # a frozen follower takes the island out within the heartbeat timeout, launcher or not
    world = island_world(member, relay, island, shard)
    member.epochs.on_change = world.follow
    if admission.initial:
        member.epochs.form(0, None)
    relay.sync()  # the followers learn epoch, rank and size (a joiner's: -1, 0, 0 until it enters)
    return world


def _follow_island(host: str, port: int, name: str, token: str, island: IslandPlace) -> World:
    """A follower of a k-worker island: not a member of the job's epochs (its leader is), it reads the job record
    with the token (a wrong token is refused here: the record does not verify), beats like any worker (the
    launcher watches it), joins the island's local group and learns the rest from its leader."""
    raw = connect(host, port)
    job = JobSpec.read(raw, token)
    auth = ControlAuth(token, job.job_id, name)
    store = authed(raw, auth)
    heartbeat = Heartbeat(host, port, name, auth=auth, new_client=lambda: authed(connect(host, port), auth))
    try:
        side = _island_group(store, island, job)
    except BaseException:
        heartbeat.stop()
        raise
    ledger = CommLedger()
    relay = IslandComm(None, ledger, side=side)
    follower = IslandFollower(
        name,
        island,
        relay,
        store,
        Liveness(store, job.heartbeat_timeout),
        heartbeat,
        job,
        new_client=lambda: authed(connect(host, port), auth),
    )
    world = island_world(
        follower, relay, island, (island.index * island.size + island.local, job.workers * island.size)
    )
    relay.on_change = world.follow
    relay.sync()
    return world


def _island_group(store, island: IslandPlace, job: JobSpec):
    """The island's local gloo group as this process's default group (DDP, ZeRO-1 and Comm(None) use it), over a
    prefix of the job's authenticated store that no other island or incarnation shares. Returns a second group of
    the same workers: the relay of exchanges in flight on the strategy's exchange thread (island_comm docstring)."""
    timeout = _dt.timedelta(seconds=local_timeout(job.timeout, job.heartbeat_timeout))
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"{island.tag}/pg", store),
        rank=island.local,
        world_size=island.size,
        timeout=timeout,
    )
    return dist.new_group(backend="gloo", timeout=timeout)


class IslandWorld(World):
    """The World of one worker of a k-worker island in an elastic job: rank = island rank * k + local index, size =
    member islands * k; "cross" and "global" are the IslandComm, "local" the island's default group."""

    place: IslandPlace | None = None
    relay: IslandComm | None = None

    @property
    def worker_names(self) -> list[str]:
        """Every worker of the member islands, in rank order (checkpoint parts are named by it)."""
        assert self.relay is not None and self.place is not None  # island_world sets both before handing it out
        return self.relay.worker_names(self.place.size)

    def follow(self, rank: int, size: int) -> None:
        assert self.place is not None  # island_world sets it before the first follow
        k = self.place.size
        self.islands = max(size, 1)  # a joiner before it enters: an island of its own
        self.size, self.rank = self.islands * k, rank * k + self.place.local


def island_world(membership, relay: IslandComm, island: IslandPlace, data_shard: tuple[int, int]) -> IslandWorld:
    world = IslandWorld(
        rank=island.local,
        size=island.size,
        islands=1,
        device=torch.device("cpu"),
        backend="gloo",
        cross_backend="gloo",
        ledger=relay.ledger,
        comms={"cross": relay, "global": relay, "local": Comm(None, relay.ledger)},
        data_shard=data_shard,
        membership=membership,
        owns_group=True,
    )
    world.place, world.relay = island, relay
    world.follow(relay.rank, relay.size)
    if island.size > 1:
        # FSDP under an outer strategy shards over mesh["local"]: here a 1-D mesh over the island's own group (the
        # default one), made once per process. Membership epochs change rank, size and islands (follow), never
        # this group, so the mesh stays right; a restarted island is new processes with a new group and mesh.
        from torch.distributed.device_mesh import init_device_mesh

        world.mesh = init_device_mesh("cpu", (island.size,), mesh_dim_names=("local",))
    return world


def elastic_world(membership: Membership, data_shard: tuple[int, int], device: torch.device | None = None) -> World:
    """The World of an elastic member: every scope but "local" (an island of one) is the membership's ElasticComm;
    rank, size and islands follow its members; `data_shard` (shard, shards) stays whoever else comes and goes.
    `device`: where it trains (elastic_device; the CPU by default); its cross Comm stages device tensors (comm)."""
    comm = membership.comm
    rank, size = (comm.rank, comm.size) if membership.epochs.members else (0, 1)  # a joiner builds before it enters
    world = World(
        rank=rank,
        size=size,
        islands=size,
        device=device or torch.device("cpu"),
        backend="gloo",
        cross_backend="gloo",
        ledger=comm.ledger,
        comms={"cross": comm, "global": comm, "local": LoneComm()},
        data_shard=data_shard,
        membership=membership,
    )

    def follow(rank: int, size: int) -> None:
        world.rank, world.size, world.islands = rank, size, size

    membership.epochs.on_change = follow
    return world


def _elastic_exit(address: str, previous):
    """An excepthook: a process the job refused, ended before admitting, or dropped prints one line and exits
    with the code `islands join` documents (3, 4, 1), not a traceback."""

    def line_of(value) -> str | None:
        if isinstance(value, Refused):
            return f"join refused by {address}: {value}"
        if isinstance(value, JobEnded):
            return f"{address}: {value}"
        if isinstance(value, (Excluded, IslandBroken, PayloadAuthError)):
            return str(value)
        return None

    return _one_line_exit(line_of, previous)


def _one_line_exit(line_of: Callable[[BaseException], str | None], previous):
    """An excepthook that prints `line_of(error)` after "islands: " and exits with the error's exit_code, or, where
    line_of gives None, hands the error to `previous`. Finalisers are skipped: a retired gloo group whose peer hung
    could hold the exit until its timeout."""

    def hook(kind, value, tb):
        line = line_of(value)
        if line is None:
            return previous(kind, value, tb)
        # the process's own stderr: torch's init_process_group wraps the hook it finds in one that swaps sys.stderr
        # for a buffer while it runs, and the line would vanish with the os._exit (an elastic island of k workers
        # makes its group after this hook is in place)
        print(f"islands: {line}", file=sys.__stderr__ or sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(value.exit_code)

    return hook
