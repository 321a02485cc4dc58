"""A local etcd cluster, on loopback or inside a network namespace (a testbed's hub), for tests and experiments
of an elastic job's replicated store (etcd-server 3.4, /usr/bin/etcd; CI installs it in .ci/run;
`EtcdCluster(3).start().url` is what `--store` takes).

Each member gets two free ports (client, peer) and a data directory on tmpfs when there is one (fsync is
cheap there, so a loaded machine does not stall Raft). Election timing is relaxed by default for a machine
shared by other jobs (heartbeat 100 ms, election timeout 1.5 s); a cluster whose leader's death must cost
little asks for shorter timing (`election_ms`, `heartbeat_ms`)."""

from __future__ import annotations

import base64
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from islands.runtime.elastic.etcd_store import (
    CA_ENV,
    CERT_ENV,
    FIRST_TRY_S,
    KEY_ENV,
    PASSWORD_FILE_ENV,
    USER_ENV,
    EtcdClient,
    EtcdLogin,
    EtcdTLS,
    leader_key,
)
from islands.runtime.netns import entered as netns_entered
from islands.testbed.system import netns_exec_prefix

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
USER = "islands"  # the user EtcdCluster(login=True) makes for the job's processes


def available() -> bool:
    return os.path.exists(ETCD)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` ports free on `host` now, drawn below the kernel's ephemeral range: a port from bind(0) is free only until
    the next outgoing connection or bind(0) takes it, and a test suite running beside the cluster makes many (a
    member that lost its port exits, and the cluster never becomes healthy)."""
    low = _ephemeral_low()
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            port = secrets.randbelow(max(low - 10000, 1)) + 10000 if low > 10001 else 0
            s = socket.socket()
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


class EtcdCluster:
    def __init__(
        self,
        members: int = 3,
        root: Path | None = None,
        tls: bool = False,
        netns: str | None = None,
        host: str = "127.0.0.1",
        login: bool = False,
        token_ttl_s: int | None = None,
        places: list[tuple[str | None, str]] | None = None,
        election_ms: int = 1500,
        heartbeat_ms: int = 100,
    ):
        """`tls`: the members serve clients over TLS and admit only clients with a certificate their own CA
        signed (etcd's --client-cert-auth); `env()` names the files a client needs (a throwaway CA, made with
        openssl in the cluster's directory). `netns`, `host`: run the members inside that network namespace,
        serving on that address (a testbed's hub and its hub_ip, so that every host of the testbed reaches
        the cluster over its own link). `login`: etcd's own authentication is enabled once the cluster is up,
        with a root user and a user USER (role: read and write on every key) whose random passwords are in the
        cluster's directory; `env()` names them. `token_ttl_s`: the members' --auth-token-ttl (etcd: 300 s).
        `places`: (namespace, address) of each member instead, e.g. one per testbed host, so that a cut link
        leaves a member on each side (the clients, this object's own included, still connect from `netns`).
        `election_ms`, `heartbeat_ms`: etcd's --election-timeout and --heartbeat-interval. With the leader killed
        nothing is written or read (reads are linearizable) until a follower's randomised election timeout, 1 to
        2 times `election_ms`, has passed (`islands bench etcd-failover`: a put through islands' client
        2.3 s after the leader's SIGKILL at 1500/100 ms, 0.76 s at 500/50 ms, with no spurious election in
        30 s beside six busy processes on two cores)."""
        if heartbeat_ms <= 0 or election_ms < 5 * heartbeat_ms:
            raise ValueError(
                f"etcd needs an election timeout of at least 5 heartbeats; got election_ms={election_ms} "
                f"and heartbeat_ms={heartbeat_ms}"
            )
        self.election_ms, self.heartbeat_ms = election_ms, heartbeat_ms
        self.n = members
        self.login, self.token_ttl_s = login, token_ttl_s
        self.netns = netns  # where clients connect from (the members are at `places`)
        self.places = list(places) if places is not None else [(netns, host)] * members
        if len(self.places) != members:
            raise ValueError(f"places names {len(self.places)} members; the cluster has {members}")
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self.root = Path(tempfile.mkdtemp(prefix="islands-etcd-", dir=root or base))
        self.tls = tls
        if tls:
            _make_certificates(self.root / "pki", sorted({ip for _, ip in self.places}))
        self.procs: list[subprocess.Popen | None] = [None] * members
        self._choose_ports()

    def _choose_ports(self) -> None:
        self.client_ports, self.peer_ports = [], []
        for place_netns, ip in self.places:
            with netns_entered(place_netns):
                client, peer = _free_ports(2, ip)
            self.client_ports.append(client)
            self.peer_ports.append(peer)
        self.initial = ",".join(
            f"m{i}=http://{ip}:{p}" for i, ((_, ip), p) in enumerate(zip(self.places, self.peer_ports))
        )

    @property
    def endpoints(self) -> list[str]:
        return [f"{ip}:{p}" for (_, ip), p in zip(self.places, self.client_ports)]

    @property
    def url(self) -> str:
        return ("etcds://" if self.tls else "etcd://") + ",".join(self.endpoints)

    def env(self) -> dict[str, str]:
        """The variables a client of this cluster needs (islands.runtime.elastic.etcd_store: EtcdTLS.from_env,
        EtcdLogin.from_env)."""
        out = {}
        if self.tls:
            pki = self.root / "pki"
            out.update(
                {CA_ENV: str(pki / "ca.crt"), CERT_ENV: str(pki / "client.crt"), KEY_ENV: str(pki / "client.key")}
            )
        if self.login:
            out.update({USER_ENV: USER, PASSWORD_FILE_ENV: str(self.root / f"{USER}.password")})
        return out

    @staticmethod
    def installed() -> bool:
        """Whether etcd-server is installed here (apt-get install etcd-server)."""
        return available()

    def client(self, timeout_s: float = 30.0, first_try_s: float = FIRST_TRY_S) -> EtcdClient:
        """islands' etcd client for this cluster (its certificates with `tls`; no login), for experiments that
        time the store itself. `first_try_s`: the client's first wait per member."""
        return self._client(None, timeout_s, first_try_s)

    def _client(self, login: EtcdLogin | None, timeout_s: float = 5.0, first_try_s: float = FIRST_TRY_S) -> EtcdClient:
        pki = self.root / "pki"
        tls = (
            EtcdTLS(ca=str(pki / "ca.crt"), cert=str(pki / "client.crt"), key=str(pki / "client.key"))
            if self.tls
            else None
        )
        return EtcdClient(
            [(ip, p) for (_, ip), p in zip(self.places, self.client_ports)],
            timeout_s=timeout_s,
            tls=tls,
            netns=self.netns,
            login=login,
            first_try_s=first_try_s,
        )

    def _enable_login(self) -> None:
        """Users root and USER with random passwords (files readable by their owner only), then auth enable."""
        client = self._client(None)
        everything = {
            "permType": "READWRITE",
            "key": base64.b64encode(b"\0").decode(),
            "range_end": base64.b64encode(b"\0").decode(),
        }  # from key \0 to range end \0: every key
        for user, role in (("root", "root"), (USER, USER)):
            password = secrets.token_urlsafe(24)
            path = self.root / f"{user}.password"
            path.write_text(password + "\n")
            path.chmod(0o600)
            client.call("auth/role/add", {"name": role})
            client.call("auth/user/add", {"name": user, "password": password})
            client.call("auth/user/grant", {"user": user, "role": role})
        client.call("auth/role/grant", {"name": USER, "perm": everything})
        client.call("auth/enable", {})

    def start_member(self, i: int, state: str = "new") -> None:
        c, p = self.client_ports[i], self.peer_ports[i]
        scheme, pki = ("https" if self.tls else "http"), self.root / "pki"
        tls = (
            [
                "--cert-file",
                str(pki / "server.crt"),
                "--key-file",
                str(pki / "server.key"),
                "--client-cert-auth",
                "--trusted-ca-file",
                str(pki / "ca.crt"),
            ]
            if self.tls
            else []
        )
        where, h = self.places[i]
        # etcd inherits its own descriptor for the log; ours is closed once Popen returns
        with open(self.root / f"m{i}.log", "a") as log:
            self.procs[i] = subprocess.Popen(  # `ip netns exec` execs etcd: the pid is the member's
                [
                    *(netns_exec_prefix(where) if where else []),
                    ETCD,
                    "--name",
                    f"m{i}",
                    "--data-dir",
                    str(self.root / f"m{i}"),
                    *tls,
                    "--listen-client-urls",
                    f"{scheme}://{h}:{c}",
                    "--advertise-client-urls",
                    f"{scheme}://{h}:{c}",
                    "--listen-peer-urls",
                    f"http://{h}:{p}",
                    "--initial-advertise-peer-urls",
                    f"http://{h}:{p}",
                    "--initial-cluster",
                    self.initial,
                    "--initial-cluster-state",
                    state,
                    "--initial-cluster-token",
                    self.root.name,
                    "--heartbeat-interval",
                    str(self.heartbeat_ms),
                    "--election-timeout",
                    str(self.election_ms),
                    "--log-level",
                    "warn",
                    "--logger",
                    "zap",
                    *(["--auth-token-ttl", str(self.token_ttl_s)] if self.token_ttl_s else []),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start(self, timeout: float = 60.0, attempts: int = 3) -> EtcdCluster:
        """Start every member and wait until each is healthy. A new cluster whose member exits while starting (its
        port was taken in between) starts again on fresh ports, up to `attempts` times."""
        fresh = not any((self.root / f"m{i}").exists() for i in range(self.n))
        for attempt in range(attempts):
            for i in range(self.n):
                self.start_member(i)
            deadline = time.monotonic() + timeout
            while not all(self.healthy(i) for i in range(self.n)):
                exited = [i for i, proc in enumerate(self.procs) if proc is not None and proc.poll() is not None]
                if exited and fresh and attempt + 1 < attempts:
                    self._start_over()
                    break
                if exited or time.monotonic() > deadline:
                    logs = self.logs()  # before stop(), which removes the directory the logs are in
                    self.stop()
                    why = f"member(s) {exited} exited" if exited else f"not healthy within {timeout:.0f} s"
                    raise RuntimeError(f"the etcd cluster did not become healthy ({why}):\n{logs}")
                time.sleep(0.1)
            else:
                break
        if self.login and not (self.root / "root.password").exists():  # a restart keeps the users (data dirs)
            self._enable_login()
        return self

    def _start_over(self) -> None:
        """Kill every member, remove their data and logs, and choose fresh ports."""
        for i in range(self.n):
            self.kill(i)
            shutil.rmtree(self.root / f"m{i}", ignore_errors=True)
            (self.root / f"m{i}.log").unlink(missing_ok=True)
        self._choose_ports()

    def _context(self):
        if not self.tls:
            return None
        pki = self.root / "pki"
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        context.load_cert_chain(str(pki / "client.crt"), str(pki / "client.key"))
        return context

    def _url(self, i: int, path: str) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoints[i]}{path}"

    def healthy(self, i: int) -> bool:
        try:
            with (
                netns_entered(self.netns),
                urllib.request.urlopen(self._url(i, "/health"), timeout=2, context=self._context()) as r,
            ):
                return b'"true"' in r.read()
        except OSError:
            return False

    def get(self, key: bytes) -> bytes | None:
        """The value of `key` (None: absent), through islands' own etcd client with this cluster's certificates
        (an experiment reads who holds the coordinator's lease this way)."""
        login = EtcdLogin.from_env(self.env()) if self.login else None
        return self._client(login).get(key)

    def coordinator(self, namespace: str) -> str | None:
        """Who holds the coordinator's lease of the elastic job whose keys live under `namespace` (the last part
        of its store address, islands-<job id>): the job host or a worker's name; None while nobody does."""
        value = self.get(leader_key((namespace.strip("/") + "/").encode()))
        return None if value is None else value.decode(errors="replace")

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
        return "\n".join(
            f"--- m{i}\n" + (self.root / f"m{i}.log").read_text()[-2000:]
            for i in range(self.n)
            if (self.root / f"m{i}.log").exists()
        )


def _make_certificates(pki: Path, hosts: list[str]) -> None:
    """A throwaway CA, a server certificate for `hosts` (its addresses) and a client certificate, all signed by the
    CA (openssl)."""
    pki.mkdir(mode=0o700)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        done = subprocess.run(["openssl", *args], cwd=pki, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {done.stderr[-500:]}")

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=islands-test-ca")
    sans = ",".join(f"IP:{h}" for h in hosts)
    (pki / "server.ext").write_text(f"subjectAltName={sans}\nextendedKeyUsage=serverAuth,clientAuth\n")
    (pki / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, subject in (("server", f"/CN={hosts[0]}"), ("client", "/CN=islands-client")):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject)
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.crt",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
        )
