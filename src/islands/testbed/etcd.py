"""A local etcd cluster on loopback, for tests and experiments of an elastic job's replicated store (etcd-server
3.4, /usr/bin/etcd; CI installs it in .ci/run; `EtcdCluster(3).start().url` is what `--store` takes).

Each member gets two free ports (client, peer) and a data directory on tmpfs when there is one (fsync is
cheap there, so a loaded machine does not stall Raft). Election timing is relaxed for a machine shared by
other jobs: heartbeat 100 ms, election timeout 1.5 s."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def available() -> bool:
    return os.path.exists(ETCD)


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class EtcdCluster:
    def __init__(self, members: int = 3, root: Path | None = None):
        self.n = members
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self.root = Path(tempfile.mkdtemp(prefix="islands-etcd-", dir=root or base))
        ports = _free_ports(2 * members)
        self.client_ports, self.peer_ports = ports[:members], ports[members:]
        self.procs: list[subprocess.Popen | None] = [None] * members
        self.initial = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(self.peer_ports))

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.client_ports]

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(self.endpoints)

    def start_member(self, i: int, state: str = "new") -> None:
        c, p = self.client_ports[i], self.peer_ports[i]
        log = open(self.root / f"m{i}.log", "a")
        self.procs[i] = subprocess.Popen(
            [ETCD, "--name", f"m{i}", "--data-dir", str(self.root / f"m{i}"),
             "--listen-client-urls", f"http://127.0.0.1:{c}", "--advertise-client-urls", f"http://127.0.0.1:{c}",
             "--listen-peer-urls", f"http://127.0.0.1:{p}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{p}",
             "--initial-cluster", self.initial, "--initial-cluster-state", state,
             "--initial-cluster-token", self.root.name, "--heartbeat-interval", "100",
             "--election-timeout", "1500", "--log-level", "warn", "--logger", "zap"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start(self, timeout: float = 60.0) -> "EtcdCluster":
        for i in range(self.n):
            self.start_member(i)
        deadline = time.monotonic() + timeout
        while not all(self.healthy(i) for i in range(self.n)):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the etcd cluster did not become healthy:\n" + self.logs())
            time.sleep(0.1)
        return self

    def healthy(self, i: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.client_ports[i]}/health", timeout=2) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        for i in range(self.n):
            self.kill(i)
        shutil.rmtree(self.root, ignore_errors=True)

    def logs(self) -> str:
        return "\n".join(f"--- m{i}\n" + (self.root / f"m{i}.log").read_text()[-2000:]
                         for i in range(self.n) if (self.root / f"m{i}.log").exists())
