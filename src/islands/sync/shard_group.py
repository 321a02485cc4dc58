"""How many ranks one FSDP sharding group spans, and the device mesh that realises it (SOTA-119, LIT-083).

FSDP over g ranks keeps 1/g of the parameters, gradients and optimizer state per rank, and gathers over
those g ranks every unit, twice per step. Sharding over the whole data-parallel world (D ranks) gives
the least memory but sends every gather over the slowest link in the world; sharding inside groups of
g and replicating across the D/g groups (hybrid sharding, HSDP) keeps the gathers inside a group and
adds one all-reduce of each rank's 1/g gradient shard across groups. The sizer picks the smallest g
whose per-rank state fits a memory budget, preferring groups that stay inside an island (g divides
the island size), so gathers stay on fast links.

Specs: "" = the island (today's default), "auto" = the sizer, "N" = N ranks.
"""

from __future__ import annotations

import os

from islands.sync.shard_plan import Unit, state_bytes_per_rank


def parse_shard_group(spec: str | int) -> str | int:
    """ "" | "auto" | a positive integer (as text). Returns "", "auto" or the int."""
    text = str(spec).strip()
    if text in ("", "auto"):
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(
        f"shard_group={spec!r}; give '' (the island), 'auto' (sized from the memory budget) "
        "or a positive number of ranks such as '2'"
    )


def candidate_groups(world_size: int, island_size: int) -> list[int]:
    """Group sizes in the sizer's order: divisors of the island (gathers stay on fast links), smallest
    first, then multiples of the island that divide the world (gathers cross islands)."""
    inside = [g for g in range(1, island_size + 1) if island_size % g == 0]
    across = [g for g in range(2 * island_size, world_size + 1, island_size) if world_size % g == 0]
    return inside + across


def check_group(g: int, world_size: int) -> None:
    if g < 1 or world_size % g:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"shard_group={g} must divide the {world_size} data-parallel ranks; choose one of {divisors}")


def choose_group(
    units: list[Unit],
    world_size: int,
    island_size: int,
    budget_bytes: int,
    optimizer_slots: int = 2,
    bytes_per_elem: int = 4,
) -> int:
    """The smallest sharding group whose largest per-rank state (parameters + gradients + optimizer slots,
    as FSDP lays them out) fits `budget_bytes`. Activations are not counted: leave room for them."""
    if budget_bytes <= 0:
        raise ValueError(f"memory budget must be > 0 bytes; got {budget_bytes}")
    need = {}
    for g in candidate_groups(world_size, island_size):
        need[g] = state_bytes_per_rank(units, g, 0, optimizer_slots, bytes_per_elem)["total"]
        if need[g] <= budget_bytes:
            return g
    smallest = min(need.values())
    raise ValueError(
        f"no sharding group fits: the state needs {smallest / 2**20:.1f} MiB per rank even sharded over "
        f"all {world_size} ranks, above the budget of {budget_bytes / 2**20:.1f} MiB; raise "
        "shard_budget_mb, add workers, or shrink the model"
    )


def resolve_group(spec: str | int, units: list[Unit], world, budget_bytes: int = 0) -> int:
    """The group size a spec means in this world: "" the island, "auto" the sizer (budget 0: this device's
    memory), N itself (checked)."""
    if spec == "":
        return world.workers_per_island
    if spec == "auto":
        island = world.workers_per_island
        budget = budget_bytes or device_memory_bytes(world.device, island)
        return choose_group(units, world.size, island, budget)
    check_group(int(spec), world.size)
    return int(spec)


def device_memory_bytes(device, ranks_on_host: int) -> int:
    """What one rank may use: the accelerator's memory, or this host's physical memory shared by its ranks."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // max(1, ranks_on_host)


def build_mesh(world, g: int):
    """A 1-D mesh (plain FSDP) when one group spans every rank, else a 2-D ("replicate", "shard") mesh
    (HSDP); the world's own ("island", "local") mesh when the groups are exactly the islands. Refused where islands
    share GPUs (World.local_backend differs from the world's: NCCL only inside each island), since every such mesh
    carries per-step traffic across islands over the gloo world."""
    check_group(g, world.size)
    if world.local_backend not in ("", world.backend) and world.islands > 1:
        raise ValueError(
            f"islands sharing GPUs keep NCCL inside each island and gloo across them (world.local_backend "
            f"{world.local_backend}, world backend {world.backend}): fsdp shards inside each island under an outer "
            "strategy there, not across islands; add an outer strategy, or give every worker a GPU of its own"
        )
    if g == world.size:
        if world.islands == 1:
            return world.mesh["local"]
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(world.device.type, (g,), mesh_dim_names=("shard",))
    if g == world.workers_per_island:
        return world.mesh  # dims (island, local): replicate across islands, shard inside each
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(world.device.type, (world.size // g, g), mesh_dim_names=("replicate", "shard"))


def cross_island_wire_bytes(
    units: list[Unit], world_size: int, islands: int, g: int, reshard: bool, elem_bytes: int = 4
) -> float:
    """Bytes per step that cross island boundaries, summed over all such links, for ring collectives over
    consecutive ranks (islands hold consecutive ranks). A ring of m ranks moves (m-1)/m of the tensor over
    each of its m links for an all-gather or reduce-scatter, twice that for an all-reduce; we count the
    links whose two ends sit on different islands."""
    island_size = world_size // islands

    def crossing_links(ranks: list[int]) -> int:
        m = len(ranks)
        if m < 2:
            return 0
        return sum(ranks[i] // island_size != ranks[(i + 1) % m] // island_size for i in range(m))

    total = 0.0
    shard_groups = [list(range(s, s + g)) for s in range(0, world_size, g)]
    replica_groups = [list(range(i, world_size, g)) for i in range(g)]
    for u in units:
        full = u.padded_numel(g) * elem_bytes
        gathers = 2 if (reshard and not u.root) else 1
        per_link = (g - 1) / g * full
        total += sum(crossing_links(r) for r in shard_groups) * per_link * (gathers + 1)  # gathers + reduce-scatter
        m = world_size // g
        if m > 1:  # HSDP: each shard group's 1/g gradient shard all-reduced across the groups
            total += sum(crossing_links(r) for r in replica_groups) * 2 * (m - 1) / m * full / g
    return total
