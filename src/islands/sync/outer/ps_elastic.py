"""The parameter server in an elastic job (issue #36, `islands train --elastic --outer ps:...,servers=S`): what an
island keeps in the job's store, the elastic control plane's authenticated one (docs/membership.md, "Security").

    ps/address        HOST:PORT of the service's store: the first epoch's rank 0 starts the supervisor (a process of
                      its own session, so it outlives that island) and writes it; every other island, a restarted
                      or joining one included, reads it here, instead of the fixed job's gloo broadcast
    ps/islands        a counter: each island process (an island of k workers: its leader) takes the next number as
                      its island on the servers, so a restarted island is a new island there (its predecessor
                      lapsed after the lease)
    ps/clock/<shard>  {"step", "island", "pushes"}: the step an island of data shard <shard> (an island of k
                      workers: its index, its workers' shards divided by k) had reached at its last acknowledged
                      push (a restarted island starts there, so the steps it loses are those of its predecessor's
                      unpushed round), its island number and the pushes the servers applied for it
    ps/island/<name>  the island number of a worker's island, written once it has the model (tests, reports)
    ps/final          set by an island once it has its final answer: a joiner that comes later finds the job over

Written through an AuthStore, a value written without the job's token reads as absent; the counter is the store's
plain add (a forged bump only skips a number).
"""

from __future__ import annotations

import json
import time

from islands.runtime.elastic.admission import JobEnded

ADDRESS = "ps/address"
ISLANDS = "ps/islands"
FINAL = "ps/final"


class ElasticService:
    """One island's view of the parameter service through the job's store (module docstring). `store`: a client of
    the job's authenticated store; `name`: this worker's name in the job; `shard`: its data shard, which a restarted
    island keeps; `timeout_s`: how long an island waits for the address; `shards`: the job's data shards."""

    def __init__(self, store, name: str, shard: int, timeout_s: float, shards: int = 1):
        self.store, self.name, self.shard, self.timeout_s = store, name, shard, timeout_s
        self.shards = max(shards, shard + 1)

    def publish(self, address: tuple[str, int]) -> None:
        host, port = address
        self.store.set(ADDRESS, f"{host}:{port}")

    def address(self) -> tuple[str, int]:
        """The service's address, once the island that starts it has written it (within timeout_s). A joiner that
        arrives after the islands' final answers has nothing to join: JobEnded."""
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check([ADDRESS]):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no parameter server address in the job's store within {self.timeout_s:.0f} s: the island "
                    "that starts the service (the first epoch's rank 0) did not write one"
                )
            time.sleep(0.05)
        if self.store.check([FINAL]):
            raise JobEnded("the parameter server had given every island its final answer before this one joined")
        host, _, port = self.store.get(ADDRESS).decode().rpartition(":")
        return host, int(port)

    def take_island(self) -> int:
        """A number of its own on the servers for this island process."""
        return int(self.store.add(ISLANDS, 1)) - 1

    def pulled(self, island: int) -> None:
        """This worker is island `island` on the servers and has pulled the global model (ps/island/<name>)."""
        self.store.set(f"ps/island/{self.name}", str(island))

    def record(self, clock: int, island: int, pushes: int) -> None:
        """The step this island had reached at its last acknowledged push (a restart starts there), with its
        island number and the pushes the servers applied for it so far."""
        self.store.set(f"ps/clock/{self.shard}", json.dumps({"step": clock, "island": island, "pushes": pushes}))

    def start_step(self, ahead: bool = False) -> int:
        """Where an island of this data shard starts: its last island's step at its last acknowledged push, or 0;
        `ahead`: the furthest step any data shard's island acknowledged (ps.REJOIN), never behind its own."""
        shards = range(self.shards) if ahead else (self.shard,)
        steps = [self._clock(s) for s in shards]
        return max([s for s in steps if s is not None] + [0])

    def _clock(self, shard: int) -> int | None:
        key = f"ps/clock/{shard}"
        return int(json.loads(self.store.get(key))["step"]) if self.store.check([key]) else None

    def finished(self) -> None:
        self.store.set(FINAL, self.name)
