"""The parameter server's processes in a test (issue #36): shard servers as threads of the test process (no
interpreter to start) or forked from the preloaded forkserver (harness.procs), and island links to them."""

from __future__ import annotations

import datetime as _dt
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from harness.procs import mp_context
from islands.sync.outer.ps_remote import RemoteLink
from islands.sync.outer.ps_service import ServiceConfig, ShardServer, serve


class ThreadService:
    """The store and one ShardServer thread per shard, in this process."""

    def __init__(self, directory: Path, config: ServiceConfig):
        config.save(directory)
        self.config, self.directory = config, directory
        self.raw = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_dt.timedelta(seconds=30)
        )
        self.address = ("127.0.0.1", int(self.raw.port))
        self.store = dist.PrefixStore("islands-ps", self.raw)
        self.servers = [ShardServer(directory, k, *self.address) for k in range(config.servers)]
        self.links: list[RemoteLink] = []  # closed at stop: no gloo pair outlives the test
        self.threads = [threading.Thread(target=s.run, daemon=True) for s in self.servers]
        for t in self.threads:
            t.start()

    def link(self, island: int, **kw) -> RemoteLink:
        kw = {"timeout_s": 120.0, "lease_s": self.config.lease_s, "tags": self.config.tags(), **kw}
        link = RemoteLink(self.address, island, self.config.bounds, **kw).start()
        self.links.append(link)
        return link

    def restart(self, shard: int, links: Sequence[RemoteLink] = (), timeout_s: float = 60.0) -> ShardServer:
        """Stop shard `shard`'s server and start a successor on the same directory, as the supervisor does after a
        kill: it rebuilds from the journal and announces a new generation (returned once it has). A kill breaks the
        islands' connections to it; a thread that ends does not (a connection thread blocked on a gloo receive
        would take the next message), so `links`' connections to that shard are broken here, as a kill's would be:
        their next request connects to the successor."""
        old = self.servers[shard]
        for link in links:
            pair = link.pairs[shard]
            if pair is not None:
                pair.close()
                link.pairs[shard] = None
        old.done.set()
        self.threads[shard].join(timeout_s)
        assert not self.threads[shard].is_alive(), f"shard {shard}'s server did not stop"
        new = ShardServer(self.directory, shard, *self.address)
        self.servers[shard], self.threads[shard] = new, threading.Thread(target=new.run, daemon=True)
        self.threads[shard].start()
        deadline = time.monotonic() + timeout_s
        while new.gen <= old.gen:
            assert time.monotonic() < deadline, f"shard {shard}'s successor did not start"
            time.sleep(0.02)
        return new

    def __enter__(self) -> ThreadService:
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.stop()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the servers now (a test's end: not waiting for islands it left open)."""
        for link in self.links:
            link.close()
        self.store.set("stop", "test")
        for server in self.servers:
            server.done.set()
        for t in self.threads:
            t.join(timeout_s)
        assert not any(t.is_alive() for t in self.threads), "a shard server did not stop"


class ForkedShard:
    """A shard server forked from the preloaded forkserver, answering as subprocess.Popen does."""

    def __init__(self, directory: Path, shard: int, host: str, port: int):
        self.proc = mp_context().Process(target=serve, args=(str(directory), shard, host, port), daemon=True)
        self.proc.start()
        assert self.proc.pid is not None
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        return self.proc.exitcode if self.proc.exitcode is not None else -1


def pushing_island(address, island: int, bounds, lease_s: float, acked) -> None:
    """An island process that pushes delta = (100 + k) everywhere for its k-th push, until it is killed, putting k
    on `acked` once the k-th push is acknowledged (the test then knows which contributions must be in the model)."""
    import time

    import torch

    from islands.sync.outer.ps_link import Message
    from islands.sync.outer.ps_wire import PULL, PUSH

    link = RemoteLink(address, island, bounds, timeout_s=120.0, lease_s=lease_s).start()
    link.send(Message(PULL, island))
    numel = bounds[-1][1]
    k = 0
    while True:
        k += 1
        link.send(Message(PUSH, island, 0, 1.0, torch.full((numel,), 100.0 + k)))
        acked.put(k)
        time.sleep(0.1)


def done_together(links: Sequence[RemoteLink], timeout_s: float = 60.0) -> None:
    """Every link sends DONE at once, each from a thread of its own (the servers answer DONE only once no island is
    still training, so one after another would wait on itself), and every one gets its final answer."""
    from islands.sync.outer.ps_link import Message
    from islands.sync.outer.ps_wire import DONE

    done = [threading.Thread(target=link.send, args=(Message(DONE, link.island),)) for link in links]
    for t in done:
        t.start()
    for t in done:
        t.join(timeout_s)
    assert all(link.final for link in links), [link.final for link in links]
