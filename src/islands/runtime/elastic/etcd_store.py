"""A torch.distributed Store on an etcd v3 cluster: the replicated store of an elastic job (issue #20 item 2).

The embedded store (a TCPStore in the job host) is one process: the job survives the launcher, not the job
host. With `--store etcd://HOST:PORT,HOST:PORT,...` the job's keys live in an etcd cluster instead, which
keeps serving while a majority of its members is up (Raft), so no single process holds the job.

How it talks to etcd: the v3 API through etcd's JSON gateway over plain HTTP (POST /v3/kv/range, /kv/put,
/kv/txn, /kv/deleterange, /lease/*; keys and values base64), with the standard library's http.client: no
new dependency. `etcds://` is the same over HTTPS, with a client certificate when the cluster asks for one
(EtcdTLS: ISLANDS_ETCD_CA, ISLANDS_ETCD_CERT, ISLANDS_ETCD_KEY). /v3/ is the gateway's path from etcd 3.4 on
(3.3 had /v3beta/, which 3.4 still accepts).
Every key of the job is under its namespace (`EtcdAddress.namespace`), so jobs can share a cluster.

Fail-over: a request that cannot reach its endpoint (refused, reset, timed out) or that the member cannot
serve (no leader, 5xx) goes to the next endpoint of the list, until `timeout_s` runs out. Reads are etcd's
default, linearizable: a member cut off from the majority answers none, so the minority side of a
partition can neither read nor write (the majority rule, docs/membership.md). Caveat: a write whose reply
was lost is sent again to the next member; set/compare_set are idempotent under that, an `add` may count
twice (membership uses `add` only for join tickets, where a skipped ticket costs one ticket-wait).

It is a Python subclass of torch.distributed.Store, so gloo's rendezvous (ProcessGroupGloo over a
PrefixStore of it) and islands' AuthStore run over it unchanged. Semantics follow torch's TCPStore:
`get` and `wait` block until the key exists (or the timeout), `add` on a missing key starts at 0,
`compare_set(key, expected, desired)` sets when the current value equals `expected` (a missing key when
`expected` is empty) and returns the value the key then holds. `end()` marks the job's namespace over:
every later `check`/`get`/`wait` of any client raises DistNetworkError, as a client of a TCPStore whose
server went away does (a joiner waiting for admission then knows the job ended); the namespace's other
keys go in the same transaction and the mark lapses after END_MARK_KEEP_S.
"""

from __future__ import annotations

import base64
import datetime as _dt
import http.client
import json
import os
import ssl
import threading
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from islands.runtime.netns import entered as netns_entered

SCHEME = "etcd://"
TLS_SCHEME = "etcds://"  # the same over TLS, with the certificates named by CA_ENV, CERT_ENV and KEY_ENV
CA_ENV = "ISLANDS_ETCD_CA"  # PEM file of the CA that signed the members' certificates (default: the system's)
CERT_ENV = "ISLANDS_ETCD_CERT"  # PEM client certificate, for a cluster that admits clients by certificate
KEY_ENV = "ISLANDS_ETCD_KEY"  # its private key
USER_ENV = "ISLANDS_ETCD_USER"  # etcd's own user/password authentication (EtcdLogin): the user name
PASSWORD_FILE_ENV = "ISLANDS_ETCD_PASSWORD_FILE"  # a file holding its password (not the password: env leaks)
ENDED_KEY = "__islands_job_ended__"  # under the namespace: the job is over (see EtcdStore.end)
END_MARK_KEEP_S = 3600  # how long that mark outlives the job's other keys (a joiner arriving later finds no job)
REQUEST_TIMEOUT_S = 3.0  # one HTTP request to one member: a frozen or cut-off member costs at most this
# The first pass over the members waits this long for each; each later pass as long again, up to
# REQUEST_TIMEOUT_S. A follower whose leader was just killed holds a request without answering (etcd waits
# its own request timeout, several seconds): at 3 s a killed leader cost every client 3 s, where the new
# leader is elected within 1-2 election timeouts. A member merely slow (a loaded machine: ~20 ms here) is
# far below it, and a pass that finds every member slow waits longer next time.
FIRST_TRY_S = 0.75
POLL_S = 0.005  # blocking get/wait poll (a linearizable read is one round trip to the leader)
CHECKED_FRESH_S = 0.05  # a get this soon after a check that read the key returns what the check read


class EtcdError(RuntimeError):
    """etcd answered with an error that is not about availability (a bad request)."""


@dataclass(frozen=True)
class EtcdAddress:
    """An etcd cluster's client endpoints (host, port) and the job's key namespace.

    Text form (what `--store` and ISLANDS_ELASTIC carry): etcd://HOST:PORT[,HOST:PORT...][/NAMESPACE]."""

    endpoints: tuple[tuple[str, int], ...]
    namespace: str = ""
    tls: bool = False  # etcds://: HTTPS to the members (EtcdTLS.from_env: the CA and the client certificate)

    @classmethod
    def parse(cls, text: str) -> EtcdAddress:
        if not is_etcd(text):
            raise ValueError(
                f"an etcd store address starts with {SCHEME} or {TLS_SCHEME} (e.g. etcd://127.0.0.1:2379,"
                f"127.0.0.1:22379,127.0.0.1:32379); got {text!r}"
            )
        tls = text.startswith(TLS_SCHEME)
        rest = text[len(TLS_SCHEME if tls else SCHEME) :]
        hosts, _, namespace = rest.partition("/")
        endpoints = []
        for part in hosts.split(","):
            host, sep, port = part.strip().rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"etcd endpoint {part!r} in {text!r} must be HOST:PORT (a member's client URL, e.g. 127.0.0.1:2379)"
                )
            endpoints.append((host, int(port)))
        if not all(c.isalnum() or c in "-_." for c in namespace):
            raise ValueError(f"the namespace {namespace!r} in {text!r} may hold letters, digits, '-', '_', '.'")
        return cls(tuple(endpoints), namespace, tls)

    def with_namespace(self, namespace: str) -> EtcdAddress:
        return EtcdAddress(self.endpoints, namespace, self.tls)

    def __str__(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        return f"{TLS_SCHEME if self.tls else SCHEME}{hosts}" + (f"/{self.namespace}" if self.namespace else "")


def is_etcd(text: str) -> bool:
    return isinstance(text, str) and (text.startswith(SCHEME) or text.startswith(TLS_SCHEME))


@dataclass(frozen=True)
class EtcdTLS:
    """How a client verifies the members and proves itself to them: the CA bundle (empty: the system's) and a
    client certificate with its key (empty: none; a cluster started with --client-cert-auth then refuses the
    client). With client certificates the store admits only holders of a certificate its CA signed: nothing
    else can read or write the job's keys, on top of the control plane's MACs (docs/membership.md)."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    @classmethod
    def from_env(cls, env=None) -> EtcdTLS:
        env = os.environ if env is None else env
        tls = cls(env.get(CA_ENV, ""), env.get(CERT_ENV, ""), env.get(KEY_ENV, ""))
        missing = [
            f"{name}={path}"
            for name, path in ((CA_ENV, tls.ca), (CERT_ENV, tls.cert), (KEY_ENV, tls.key))
            if path and not os.path.isfile(path)
        ]
        if missing:
            raise ValueError(f"etcd TLS files not found: {', '.join(missing)}")
        if bool(tls.cert) != bool(tls.key):
            raise ValueError(
                f"a client certificate needs both {CERT_ENV} and {KEY_ENV}; got only "
                f"{CERT_ENV if tls.cert else KEY_ENV}"
            )
        return tls

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca or None)
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx


@dataclass(frozen=True)
class EtcdLogin:
    """A user of etcd's own authentication (`etcdctl auth enable`): the client asks each member it talks to for
    a token (POST /v3/auth/authenticate) and sends it with every request. With it, nothing without the
    password reads or writes the job's keys, even over plain HTTP (the password and tokens then travel in
    the clear: pair it with etcds:// where the links are not yours). `repr` hides the password."""

    user: str
    password: str = field(repr=False)

    @classmethod
    def from_env(cls, env=None) -> EtcdLogin | None:
        """ISLANDS_ETCD_USER and ISLANDS_ETCD_PASSWORD_FILE (both or neither); None when neither is set."""
        env = os.environ if env is None else env
        user, path = env.get(USER_ENV, ""), env.get(PASSWORD_FILE_ENV, "")
        if not user and not path:
            return None
        if not user or not path:
            raise ValueError(
                f"etcd authentication needs both {USER_ENV} (the user) and {PASSWORD_FILE_ENV} (a file "
                f"holding its password); got only {USER_ENV if user else PASSWORD_FILE_ENV}"
            )
        try:
            with open(path, encoding="utf-8") as f:
                password = f.read().rstrip("\r\n")
        except OSError as e:
            raise ValueError(f"{PASSWORD_FILE_ENV}={path}: cannot read the etcd password ({e.strerror})") from None
        if not password:
            raise ValueError(f"{PASSWORD_FILE_ENV}={path} is empty: it should hold the etcd user's password")
        return cls(user, password)


def _tls_refusal(e: ssl.SSLError) -> str | None:
    """What is wrong when a TLS handshake failed for a reason of configuration, not of availability."""
    text = str(e).lower()
    if isinstance(e, ssl.SSLCertVerificationError) or "certificate verify failed" in text:
        return f"the member's certificate does not verify ({e}); set {CA_ENV} to the CA that signed it"
    if "certificate required" in text or "bad certificate" in text or "unknown ca" in text:
        return (
            f"the member refused this client's certificate ({e}); set {CERT_ENV} and {KEY_ENV} to a client "
            "certificate the cluster's CA signed"
        )
    return None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, list):  # torch hands some values over as a list of ints
        return bytes(value)
    raise TypeError(f"a store value must be str or bytes; got {type(value).__name__}")


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key after every key starting with `prefix` (etcd's range_end for a prefix)."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


class _HTTP(http.client.HTTPConnection):
    netns: str | None = None

    def connect(self):
        with netns_entered(self.netns):  # the socket lives in the namespace it was made in
            super().connect()


class _HTTPS(http.client.HTTPSConnection):
    netns: str | None = None

    def connect(self):
        with netns_entered(self.netns):
            super().connect()


class EtcdClient:
    """JSON-over-HTTP calls to an etcd v3 cluster with fail-over between its client endpoints. Thread-safe:
    each thread keeps its own keep-alive connection."""

    def __init__(
        self,
        endpoints,
        timeout_s: float = 30.0,
        tls: EtcdTLS | None = None,
        netns: str | None = None,
        login: EtcdLogin | None = None,
        first_try_s: float = FIRST_TRY_S,
    ):
        """`netns`: a named network namespace to open connections in (islands.runtime.netns: a launcher outside
        a testbed whose etcd serves on the testbed's hub). `login`: a user of the cluster's own authentication.
        `first_try_s`: how long the first pass over the members waits on each (FIRST_TRY_S)."""
        if first_try_s <= 0:
            raise ValueError(f"first_try_s must be > 0 seconds, got {first_try_s}")
        self.first_try_s = first_try_s
        self.endpoints = list(endpoints)
        self.login = login
        # endpoint -> auth token: etcd's default ("simple") tokens are known only to the member that issued
        # them and lapse after its --auth-token-ttl (300 s) unused, so each member gets its own, renewed on refusal
        self._tokens: dict[int, str] = {}
        self._tokens_lock = threading.Lock()
        self.logins = 0  # tokens asked for (for tests: a lapsed token is renewed)
        self.netns = netns
        if not self.endpoints:
            raise ValueError("an etcd client needs at least one endpoint")
        self.timeout_s = timeout_s
        self._ssl = tls.context() if tls is not None else None
        self._current = 0  # the endpoint that answered last: tried first
        self._local = threading.local()
        self.failovers = 0  # requests that moved to another endpoint (for reports and tests)

    def _conn(self, i: int) -> http.client.HTTPConnection:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        if i not in conns:
            host, port = self.endpoints[i]
            conns[i] = (
                _HTTP(host, port, timeout=REQUEST_TIMEOUT_S)
                if self._ssl is None
                else _HTTPS(host, port, timeout=REQUEST_TIMEOUT_S, context=self._ssl)
            )
            conns[i].netns = self.netns
        return conns[i]

    def _drop(self, i: int) -> None:
        conn = getattr(self._local, "conns", {}).pop(i, None)
        if conn is not None:
            conn.close()

    def _post(
        self, i: int, path: str, data: bytes, token: str | None, wait_s: float = REQUEST_TIMEOUT_S
    ) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = token
        conn = self._conn(i)
        conn.timeout = wait_s  # a new connection's connect and reads
        if conn.sock is not None:  # a kept-alive one's reads
            conn.sock.settimeout(wait_s)
        conn.request("POST", f"/v3/{path}", body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()

    def _token(self, i: int) -> str | None:
        """Member i's token for self.login (asked for once, then kept); None without a login."""
        if self.login is None:
            return None
        with self._tokens_lock:
            token = self._tokens.get(i)
        if token is not None:
            return token
        data = json.dumps({"name": self.login.user, "password": self.login.password}).encode()
        status, payload = self._post(i, "auth/authenticate", data, None)
        answer, message = _decode(payload)
        if status == 200 and answer.get("token"):
            with self._tokens_lock:
                self._tokens[i] = answer["token"]
                self.logins += 1
            return answer["token"]
        if "authentication is not enabled" in message:
            with self._tokens_lock:
                self._tokens[i] = ""  # the cluster does not ask for one: send none
            return ""
        if status < 500 and not _unavailable(message):
            raise EtcdError(
                f"etcd refused the login of user {self.login.user!r} ({message}); check "
                f"{USER_ENV} and the password in {PASSWORD_FILE_ENV}"
            )
        raise http.client.HTTPException(message)  # the member cannot serve now: fail over like any request

    def call(self, path: str, body: dict) -> dict:
        data = json.dumps(body).encode()
        deadline = time.monotonic() + self.timeout_s
        start, errors = self._current, []
        attempt = 0
        renewed: set[int] = set()  # members whose token was renewed during this call (once each)
        while True:
            i = (start + attempt) % len(self.endpoints)
            try:
                token = self._token(i)
                wait_s = min(REQUEST_TIMEOUT_S, self.first_try_s * (1 + attempt // len(self.endpoints)))
                status, payload = self._post(i, path, data, token or None, wait_s)
            except ssl.SSLError as e:
                self._drop(i)
                why = _tls_refusal(e)
                if why is not None:
                    raise EtcdError(f"etcd {self.endpoints[i][0]}:{self.endpoints[i][1]}: {why}") from None
                errors.append(f"{self.endpoints[i][0]}:{self.endpoints[i][1]}: {type(e).__name__}: {e}")
            except (OSError, http.client.HTTPException) as e:
                self._drop(i)
                errors.append(f"{self.endpoints[i][0]}:{self.endpoints[i][1]}: {type(e).__name__}: {e}")
            else:
                answer, message = _decode(payload)
                if status == 200 and "error" not in answer:
                    if i != self._current:
                        self._current = i
                        self.failovers += 1
                    return answer
                asks_login = "invalid auth token" in message or "user name is empty" in message
                if asks_login and self.login is not None and i not in renewed:
                    # the token lapsed, the member restarted, or auth was enabled since: ask again, same member
                    renewed.add(i)
                    with self._tokens_lock:
                        self._tokens.pop(i, None)
                    continue
                if asks_login:
                    raise EtcdError(
                        f"etcd {path}: the cluster requires a login ({message}); set {USER_ENV} and "
                        f"{PASSWORD_FILE_ENV} (a file holding the password) for every process of the job"
                    )
                if "permission denied" in message:
                    who = f"user {self.login.user!r}" if self.login is not None else "this client"
                    raise EtcdError(
                        f"etcd {path}: permission denied to {who}: grant its role read and write on "
                        "the job's key prefix (etcdctl role grant-permission --prefix)"
                    )
                if "HTTPS server" in message:  # plain HTTP to a member that speaks TLS
                    raise EtcdError(
                        f"etcd {path}: the members speak TLS; address them as {TLS_SCHEME}... "
                        f"(with {CA_ENV}, {CERT_ENV} and {KEY_ENV} as needed)"
                    )
                if status < 500 and not _unavailable(message):
                    raise EtcdError(f"etcd {path}: {message}")
                errors.append(f"{self.endpoints[i][0]}:{self.endpoints[i][1]}: {message}")
            attempt += 1
            if time.monotonic() > deadline:
                hint = (
                    f" (if the members speak TLS, address them as {TLS_SCHEME}...)"
                    if self._ssl is None and any("RemoteDisconnected" in e for e in errors)
                    else ""
                )
                raise dist.DistNetworkError(
                    f"no etcd member answered {path} within {self.timeout_s:.0f} s: "
                    + "; ".join(errors[-len(self.endpoints) :])
                    + hint
                )
            if attempt % len(self.endpoints) == 0:
                time.sleep(0.1)  # every member refused: an election may be under way

    # ---- kv -----------------------------------------------------------------------------------------
    def range(self, key: bytes, *, prefix: bool = False, count_only: bool = False) -> dict:
        body: dict[str, str | bool] = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(_prefix_end(key))
        if count_only:
            body["count_only"] = True
        return self.call("kv/range", body)

    def get(self, key: bytes) -> bytes | None:
        kvs = self.range(key).get("kvs") or []
        return _unb64(kvs[0].get("value", "")) if kvs else None

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        self.call("kv/put", body)

    def txn(self, compare: list, success: list, failure: list) -> dict:
        return self.call("kv/txn", {"compare": compare, "success": success, "failure": failure})

    def delete(self, key: bytes, *, prefix: bool = False) -> int:
        body = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(_prefix_end(key))
        return int(self.call("kv/deleterange", body).get("deleted", 0))

    # ---- leases ---------------------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> int:
        return int(self.call("lease/grant", {"TTL": str(int(ttl_s))})["ID"])

    def keepalive(self, lease: int) -> bool:
        """Refresh a lease; False when it has expired (etcd then answers TTL 0 or none)."""
        result = self.call("lease/keepalive", {"ID": str(lease)}).get("result", {})
        return int(result.get("TTL", 0)) > 0

    def revoke(self, lease: int) -> None:
        try:
            self.call("lease/revoke", {"ID": str(lease)})
        except EtcdError:
            pass  # already gone


def _decode(payload: bytes) -> tuple[dict, str]:
    """A member's answer as JSON (a body that is not JSON becomes {"error": its start}) and its error message
    (meaningful only when the request failed)."""
    try:
        answer = json.loads(payload) if payload else {}
    except ValueError:
        answer = {"error": payload[:200].decode(errors="replace")}
    return answer, str(answer.get("error") or answer.get("message") or payload[:200])


def _unavailable(message: str) -> bool:
    m = message.lower()
    return any(
        s in m
        for s in (
            "no leader",
            "timed out",
            "unavailable",
            "leader changed",
            "not capable",
            "too many requests",
            "stopped",
            "connection",
        )
    )


def cmp_absent(key: bytes) -> dict:
    return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}


def cmp_value(key: bytes, value: bytes) -> dict:
    return {"key": _b64(key), "result": "EQUAL", "target": "VALUE", "value": _b64(value)}


def cmp_mod(key: bytes, revision: int) -> dict:
    return {"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": str(revision)}


def cmp_created(key: bytes, revision: int) -> dict:
    return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": str(revision)}


def op_put(key: bytes, value: bytes, lease: int = 0) -> dict:
    put = {"key": _b64(key), "value": _b64(value)}
    if lease:
        put["lease"] = str(lease)
    return {"request_put": put}


def op_range(key: bytes) -> dict:
    return {"request_range": {"key": _b64(key)}}


def _range_kv(response: dict) -> dict | None:
    kvs = response.get("response_range", {}).get("kvs") or []
    return kvs[0] if kvs else None


class EtcdStore(dist.Store):
    """torch.distributed.Store over an etcd v3 cluster (module docstring). Keys are put under
    `address.namespace` + "/" + `key_prefix`. `fence`, when given as (key, create_revision), makes every write a
    transaction that succeeds only while that key still exists with that creation revision (a coordinator's
    leadership key, islands.runtime.elastic.membership): a deposed leader's writes are refused (NotLeader)."""

    def __init__(
        self,
        address: EtcdAddress | str,
        timeout_s: float = 30.0,
        fence: tuple[bytes, int] | None = None,
        client: EtcdClient | None = None,
        key_prefix: str = "",
        netns: str | None = None,
    ):
        super().__init__()
        self.address = EtcdAddress.parse(address) if isinstance(address, str) else address
        self.client = client or EtcdClient(
            self.address.endpoints,
            timeout_s,
            EtcdTLS.from_env() if self.address.tls else None,
            netns=netns,
            login=EtcdLogin.from_env(),
        )
        self.timeout_s = timeout_s
        self.fence = fence
        self.root = (self.address.namespace + "/").encode() if self.address.namespace else b""
        self.key_prefix = key_prefix  # inside the namespace (membership's "islands/"), like a PrefixStore
        self._checked = threading.local()  # the values the thread's last check read (get serves them once)
        self.host = self.address.endpoints[0][
            0
        ]  # islands.runtime.elastic.transfer.store_host: the interface to serve on
        # how often a waiting member should read this store (islands.runtime.elastic.commit.Commit): each read is an
        # HTTP request that costs etcd CPU, ~1 ms here against ~0.2 ms for a TCPStore
        self.poll_interval = 0.02

    def fenced(self, key: bytes, revision: int) -> EtcdStore:
        """A view of the same cluster and namespace whose writes hold only while `key` has `revision`."""
        return EtcdStore(
            self.address, self.timeout_s, fence=(key, revision), client=self.client, key_prefix=self.key_prefix
        )

    def _k(self, key: str) -> bytes:
        return self.root + (self.key_prefix + key).encode()

    def _timeout(self, timeout) -> float:
        if isinstance(timeout, _dt.timedelta):
            return timeout.total_seconds()
        return self.timeout_s if timeout is None else float(timeout)

    def _ended_check(self, responses: list) -> None:
        if _range_kv(responses[-1]) is not None:
            raise dist.DistNetworkError("the job's store was closed: the elastic job has ended")

    # ---- writes ----------------------------------------------------------------------------------------
    def _write(self, compare: list, success: list, failure: list) -> dict:
        if self.fence is not None:
            key, rev = self.fence
            answer = self.client.txn(
                [cmp_created(key, rev)],
                [{"request_txn": {"compare": compare, "success": success, "failure": failure}}],
                [],
            )
            if not answer.get("succeeded"):
                raise NotLeader("this coordinator no longer holds the leadership lease; its write was refused")
            return answer["responses"][0]["response_txn"]
        return self.client.txn(compare, success, failure)

    def set(self, key: str, value) -> None:
        getattr(self._checked, "values", {}).pop(key, None)  # this thread's own write: never serve the old value
        self._write([], [op_put(self._k(key), _bytes(value))], [])

    def compare_set(self, key: str, expected, desired) -> bytes:
        getattr(self._checked, "values", {}).pop(key, None)  # this thread's own write: never serve the old value
        k, expected, desired = self._k(key), _bytes(expected), _bytes(desired)
        compare = [cmp_absent(k)] if not expected else [cmp_value(k, expected)]
        answer = self._write(compare, [op_put(k, desired)], [op_range(k)])
        if answer.get("succeeded"):
            return desired
        kv = _range_kv(answer["responses"][0])
        if kv is None:
            return expected  # missing and a non-empty expected value: nothing set (TCPStore's answer)
        current = _unb64(kv.get("value", ""))
        if not expected and current == b"":  # present but empty counts as the expected empty value
            return self._cas_empty(k, desired)
        return current

    def _cas_empty(self, k: bytes, desired: bytes) -> bytes:
        answer = self._write([cmp_value(k, b"")], [op_put(k, desired)], [op_range(k)])
        if answer.get("succeeded"):
            return desired
        kv = _range_kv(answer["responses"][0])
        return _unb64(kv.get("value", "")) if kv else b""

    def add(self, key: str, amount: int) -> int:
        getattr(self._checked, "values", {}).pop(key, None)  # this thread's own write: never serve the old value
        k = self._k(key)
        while True:
            answer = self.client.range(k)
            kvs = answer.get("kvs") or []
            if not kvs:
                new = int(amount)
                compare = [cmp_absent(k)]
            else:
                new = int(_unb64(kvs[0].get("value", "")) or b"0") + int(amount)
                compare = [cmp_mod(k, int(kvs[0]["mod_revision"]))]
            if amount == 0 and kvs:
                return new
            if self._write(compare, [op_put(k, str(new).encode())], []).get("succeeded"):
                return new

    def delete_key(self, key: str) -> bool:
        getattr(self._checked, "values", {}).pop(key, None)  # this thread's own write: never serve the old value
        if self.fence is not None:
            k = self._k(key)
            answer = self._write([], [{"request_delete_range": {"key": _b64(k)}}], [])
            return int(answer["responses"][0].get("response_delete_range", {}).get("deleted", 0)) > 0
        return self.client.delete(self._k(key)) > 0

    def multi_set(self, keys, values) -> None:
        for key, value in zip(keys, values):
            self.set(key, value)

    def append(self, key: str, value) -> None:
        getattr(self._checked, "values", {}).pop(key, None)  # this thread's own write: never serve the old value
        k, value = self._k(key), _bytes(value)
        while True:
            kvs = self.client.range(k).get("kvs") or []
            if not kvs:
                ok = self._write([cmp_absent(k)], [op_put(k, value)], []).get("succeeded")
            else:
                old = _unb64(kvs[0].get("value", ""))
                ok = self._write([cmp_mod(k, int(kvs[0]["mod_revision"]))], [op_put(k, old + value)], []).get(
                    "succeeded"
                )
            if ok:
                return

    # ---- reads ------------------------------------------------------------------------------------------
    def _read(self, keys: list[str]) -> list[dict | None]:
        """One linearizable transaction reading `keys` and the namespace's end mark."""
        ops = [op_range(self._k(k)) for k in keys] + [op_range(self.root + ENDED_KEY.encode())]
        responses = self.client.txn([], ops, []).get("responses", [])
        self._ended_check(responses)
        return [_range_kv(r) for r in responses[:-1]]

    def check(self, keys) -> bool:
        keys = list(keys)
        kvs = self._read(keys)
        # islands' callers (AuthStore, get_json, Liveness) get right after they check: the values this read
        # already carried serve that get, once and only just after, halving their round trips to etcd
        now = time.monotonic()
        self._checked.values = {k: (_unb64(kv.get("value", "")), now) for k, kv in zip(keys, kvs) if kv is not None}
        return all(kv is not None for kv in kvs)

    def get(self, key: str) -> bytes:
        seen = getattr(self._checked, "values", {}).pop(key, None)
        if seen is not None and time.monotonic() - seen[1] < CHECKED_FRESH_S:
            return seen[0]
        return self.multi_get([key])[0]

    def multi_get(self, keys, timeout=None) -> list[bytes]:
        keys = list(keys)
        deadline = time.monotonic() + self._timeout(timeout)
        while True:
            kvs = self._read(keys)
            if all(kv is not None for kv in kvs):
                return [_unb64(kv.get("value", "")) for kv in kvs if kv is not None]  # all are
            if time.monotonic() > deadline:
                missing = [k for k, kv in zip(keys, kvs) if kv is None]
                raise dist.DistStoreError(f"etcd store: keys {missing} not set within {self._timeout(timeout):.0f} s")
            time.sleep(POLL_S)

    def wait(self, keys, timeout=None) -> None:
        self.multi_get(list(keys), timeout)

    def num_keys(self) -> int:
        return int(self.client.range(self._k(""), prefix=True, count_only=True).get("count", 0))

    # ---- the job's end ----------------------------------------------------------------------------------
    def end(self, keep_s: int = END_MARK_KEEP_S) -> None:
        """Mark the job's namespace over (clients then see the store as gone) and delete every other key of it,
        in one transaction; the mark itself lapses after `keep_s` (an etcd lease), so a finished job leaves
        nothing in the cluster. Without a namespace only the mark is written (the rest is not this job's)."""
        mark = self.root + ENDED_KEY.encode()
        put = op_put(mark, b"1", self.client.grant(keep_s))
        if not self.root:
            self.client.txn([], [put], [])
            return
        around = [
            {"request_delete_range": {"key": _b64(self.root), "range_end": _b64(mark)}},
            {"request_delete_range": {"key": _b64(mark + b"\0"), "range_end": _b64(_prefix_end(self.root))}},
        ]
        self.client.txn([], [*around, put], [])

    def ended(self) -> bool:
        return self.client.get(self.root + ENDED_KEY.encode()) is not None


class NotLeader(RuntimeError):
    """A fenced write of a coordinator that lost its leadership lease (another coordinator leads now)."""


def leader_key(namespace_root: bytes) -> bytes:
    return namespace_root + b"__islands_coordinator__"
