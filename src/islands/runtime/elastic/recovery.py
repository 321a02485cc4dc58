"""Live recovery: a joiner fetches the global state from several peers in checksummed chunks (issue #20, item 5).

A state (any picklable tree holding tensors: a model's state_dict, an optimizer's, a step counter) is
serialised once per serving peer into a `StateImage`: one flat payload (every tensor's bytes, 64-byte
aligned, or its checkpoint-codec blob when a `TensorCodec` is given) cut into fixed-size chunks, and a
`Manifest` naming the chunk sizes, one XXH3-64 per chunk, the tensors' places in the payload and the
tree's skeleton (the pickle with each tensor replaced by its index). The manifest's BLAKE2b digest
names the state: two peers with the same digest serve the same bytes.

`fetch_state(peers)` (the joiner) takes the manifest from the first peer that answers (or insists on a
digest it was told), opens one connection per peer whose manifest matches and pulls chunks from a
shared queue: a peer that answers faster takes more chunks (work stealing), and each connection keeps
a few requests in flight so a round trip per chunk costs no link time. Every chunk is received straight
into its place in one buffer and checked against its checksum; a damaged chunk is fetched again, from
another peer when one is left that has not served it damaged, at most `attempts` times; a peer that
breaks the connection gives its outstanding chunks back to the queue. Nothing is returned (or loaded
by the caller) until every chunk verified: the result is the tree, bit for bit, or `RecoveryError`.

Transport: plain TCP, one server thread per serving peer (`StateServer`) over its snapshot. Each
connection starts with a challenge-response: the server sends a random nonce and the client must
answer HMAC-SHA256(secret, "islands-recovery|" + nonce), so only holders of the job's secret read the
state (the same construction as membership.py's join proof). Wire format, all little-endian:
  server -> client  b"ISRC", version (u8), nonce (16 B)
  client -> server  proof (32 B); server -> client b"\\x01" (accepted) or closes
  client -> server  b"M" + u32 0      server -> client  u64 length + manifest bytes
  client -> server  b"C" + u32 index  server -> client  u64 length + the chunk's bytes
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import io
import json
import os
import pickle
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

MAGIC = b"ISRC"
VERSION = 1
CHUNK_BYTES = 1 << 20  # 1 MiB: ~80 ms at 100 Mbit/s, so a refetch costs little and 3 peers share ~100 chunks
ALIGN = 64  # each raw tensor starts 64-byte aligned in the payload, so views of any dtype are aligned
DEPTH = 4  # requests in flight per connection: hides the request round trip behind the chunks still arriving
ATTEMPTS = 3  # fetches of one chunk before the recovery gives up on it
_REQ = struct.Struct("<cI")
_LEN = struct.Struct("<Q")
_NONCE = 16


class RecoveryError(RuntimeError):
    """The state could not be received whole: every peer failed, a chunk stayed damaged, or manifests disagree."""


# ---- the state as bytes ---------------------------------------------------------------------------
def _raw_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.layout != torch.strided or t.is_quantized:
        raise TypeError(
            f"live recovery moves dense tensors only; got layout {t.layout} (quantized={t.is_quantized}): "
            "convert it with .to_dense() or .dequantize() first"
        )
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    # numpy's stubs give ndarray __buffer__ only for Python >= 3.12; it has the buffer protocol on every version
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


class _Pickler(pickle.Pickler):
    """Pickles the tree with every tensor replaced by its index in `tensors`."""

    def __init__(self, buf, tensors: list):
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
            return len(self.tensors) - 1
        return None


class _Unpickler(pickle.Unpickler):
    """Unpickling runs code the pickle names: only a skeleton from an authenticated peer (the job's secret) whose
    manifest digest matched is ever read, the same trust torch.load(weights_only=False) of the old path had."""

    def __init__(self, buf, tensors: list):
        super().__init__(buf)
        self.tensors = tensors

    def persistent_load(self, pid):
        return self.tensors[pid]


@dataclass(frozen=True)
class Manifest:
    """What a joiner needs to fetch and check a state: chunking, checksums, tensor places, skeleton."""

    chunk_bytes: int
    total: int  # payload bytes
    checksums: tuple[int, ...]  # XXH3-64 of each chunk
    tensors: tuple[tuple, ...]  # (dtype name, shape, payload offset, stored length, encoded by the codec)
    skeleton: bytes  # the tree pickled with tensors as persistent ids
    digest: str = ""  # BLAKE2b-256 of all of the above; filled in by __post_init__ when empty

    def __post_init__(self):
        if self.chunk_bytes < 1 or self.total < 0:
            raise RecoveryError(f"manifest has chunk_bytes {self.chunk_bytes} and total {self.total}: not a state")
        if len(self.checksums) != self.chunks:
            raise RecoveryError(f"manifest lists {len(self.checksums)} checksums for {self.chunks} chunks")
        want = self._digest()
        if not self.digest:
            object.__setattr__(self, "digest", want)
        elif not hmac.compare_digest(self.digest, want):
            raise RecoveryError("the manifest does not match its own digest: it was damaged on the way")

    @property
    def chunks(self) -> int:
        return -(-self.total // self.chunk_bytes)

    def span(self, index: int) -> tuple[int, int]:
        begin = index * self.chunk_bytes
        return begin, min(begin + self.chunk_bytes, self.total)

    def _head(self) -> bytes:
        return json.dumps(
            {
                "chunk_bytes": self.chunk_bytes,
                "total": self.total,
                "checksums": list(self.checksums),
                "tensors": [list(t) for t in self.tensors],
            },
            separators=(",", ":"),
        ).encode()

    def _digest(self) -> str:
        h = hashlib.blake2b(digest_size=32)
        head = self._head()
        h.update(_LEN.pack(len(head)) + head)
        h.update(self.skeleton)
        return h.hexdigest()

    def to_bytes(self) -> bytes:
        head = self._head()
        return _LEN.pack(len(head)) + head + self.skeleton + self.digest.encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        try:
            (n,) = _LEN.unpack_from(data, 0)
            head = json.loads(data[8 : 8 + n])
            skeleton, digest = data[8 + n : -64], data[-64:].decode()
            return cls(
                int(head["chunk_bytes"]),
                int(head["total"]),
                tuple(int(c) for c in head["checksums"]),
                tuple(tuple(t) for t in head["tensors"]),
                bytes(skeleton),
                digest,
            )
        except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise RecoveryError(f"unreadable recovery manifest ({len(data)} bytes): {exc}") from exc


@dataclass
class StateImage:
    """One peer's serialised snapshot: the payload and its manifest. Build it once; serve it to any joiner."""

    manifest: Manifest
    payload: memoryview

    @classmethod
    def build(cls, state, chunk_bytes: int = CHUNK_BYTES, codec=None) -> StateImage:
        """`state`: any picklable tree of tensors and plain values. `codec`: an islands.checkpoint.codec.TensorCodec
        to store each tensor compressed (lossless), or None for raw bytes. Tensors are only read."""
        if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be a positive integer; got {chunk_bytes!r}")
        tensors: list[torch.Tensor] = []
        buf = io.BytesIO()
        _Pickler(buf, tensors).dump(state)
        parts, entries, pos = [], [], 0
        for t in tensors:
            if codec is not None:
                data, encoded = codec.encode(t.detach().cpu()), True
            else:
                data, encoded = _raw_bytes(t), False
                pos += -pos % ALIGN
            parts.append((pos, data))
            entries.append((str(t.dtype).removeprefix("torch."), list(t.shape), pos, len(data), encoded))
            pos += len(data)
        payload = bytearray(pos)  # one buffer; zero padding between tensors
        view = memoryview(payload)
        for at, data in parts:
            view[at : at + len(data)] = memoryview(data).cast("B")
        checksums = tuple(xxhash.xxh3_64_intdigest(view[i : i + chunk_bytes]) for i in range(0, pos, chunk_bytes))
        return cls(Manifest(chunk_bytes, pos, checksums, tuple(tuple(e) for e in entries), buf.getvalue()), view)

    def chunk(self, index: int) -> memoryview:
        begin, end = self.manifest.span(index)
        return self.payload[begin:end]


def rebuild(manifest: Manifest, payload, decode=None) -> object:
    """The tree from a verified payload. Raw tensors are views of `payload` (no copy); coded ones go through
    `decode` (islands.checkpoint.codec.decode_tensor: passed in, as the checkpoint package imports the runtime)."""
    if decode is None and any(t[4] for t in manifest.tensors):
        raise RecoveryError(
            "this state was served through the checkpoint codec: pass decode=islands.checkpoint.codec."
            "decode_tensor to fetch_state to read it"
        )
    tensors = []
    for dtype_name, shape, at, length, encoded in manifest.tensors:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise RecoveryError(f"the manifest names dtype {dtype_name!r}, which this torch does not have")
        if encoded:
            tensors.append(decode(memoryview(payload)[at : at + length]))
        elif length == 0:
            tensors.append(torch.empty(shape, dtype=dtype))
        else:
            raw = torch.frombuffer(payload, dtype=torch.uint8, count=length, offset=at)
            tensors.append(raw.view(dtype).reshape(shape))
    return _Unpickler(io.BytesIO(manifest.skeleton), tensors).load()


# ---- authentication ---------------------------------------------------------------------------------
def _proof(secret: bytes | None, nonce: bytes) -> bytes:
    return hmac.new(secret or b"", b"islands-recovery|" + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n


# ---- serving ----------------------------------------------------------------------------------------
class StateServer:
    """Serves one StateImage over TCP until closed. `secret`: the job's token (bytes); None serves anyone
    who knows no secret either (tests, a private testbed)."""

    def __init__(self, image: StateImage, host: str = "127.0.0.1", port: int = 0, secret: bytes | None = None):
        self.image, self.secret = image, secret
        self._manifest = image.manifest.to_bytes()
        self._sock = socket.create_server((host, port), backlog=64)
        self.address = self._sock.getsockname()[:2]
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.served = 0  # chunks sent
        self.bytes_sent = 0
        self.refused = 0  # connections whose proof was wrong
        self._thread = threading.Thread(target=self._accept, name="islands-recovery-server", daemon=True)
        self._thread.start()

    def chunk(self, index: int) -> memoryview:
        """The bytes sent for chunk `index` (tests override it to serve damage)."""
        return self.image.chunk(index)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="islands-recovery-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = os.urandom(_NONCE)
            conn.sendall(MAGIC + bytes([VERSION]) + nonce)
            if not hmac.compare_digest(_recv_exact(conn, 32), _proof(self.secret, nonce)):
                self.refused += 1
                return
            conn.sendall(b"\x01")
            chunks = self.image.manifest.chunks
            while not self._closed.is_set():
                op, arg = _REQ.unpack(_recv_exact(conn, _REQ.size))
                if op == b"M":
                    conn.sendall(_LEN.pack(len(self._manifest)) + self._manifest)
                elif op == b"C" and arg < chunks:
                    data = self.chunk(arg)
                    conn.sendall(_LEN.pack(len(data)))
                    conn.sendall(data)
                    self.served += 1
                    self.bytes_sent += len(data)
                else:
                    return  # a request this server does not know: drop the connection
        except (OSError, ConnectionError, struct.error):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop serving: the listening socket and every open connection (a joiner mid-transfer sees the break)."""
        self._closed.set()
        for how in (lambda: self._sock.shutdown(socket.SHUT_RDWR), self._sock.close):  # shutdown wakes accept()
            try:
                how()
            except OSError:
                pass
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2)

    def __enter__(self) -> StateServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def local_address_towards(host: str) -> str:
    """This machine's address on the route to `host` (where the job's store is): the address peers reach it at.
    No packet is sent (a UDP socket's connect only picks the route)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


# ---- fetching ---------------------------------------------------------------------------------------
@dataclass
class FetchReport:
    """What one fetch did: per peer, chunks verified and damaged; refetches; seconds; bytes moved."""

    digest: str = ""
    payload_bytes: int = 0
    seconds: float = 0.0
    chunks: int = 0
    per_peer: dict = field(default_factory=dict)  # "host:port" -> {"chunks", "bytes", "damaged", "error"}
    refetched: int = 0
    skipped: dict = field(default_factory=dict)  # peers not used, with why

    @property
    def rate_bytes_per_s(self) -> float:
        return self.payload_bytes / self.seconds if self.seconds > 0 else 0.0


def _addr(peer) -> tuple[str, int]:
    if isinstance(peer, str):
        host, _, port = peer.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"a recovery peer is HOST:PORT or (host, port); got {peer!r}")
        return host, int(port)
    host, port = peer
    return str(host), int(port)


def _name(addr: tuple[str, int]) -> str:
    return f"{addr[0]}:{addr[1]}"


class _Conn:
    def __init__(self, addr: tuple[str, int], secret: bytes | None, timeout: float):
        self.addr = addr
        self.sock = socket.create_connection(addr, timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = _recv_exact(self.sock, len(MAGIC) + 1 + _NONCE)
        if hello[:4] != MAGIC or hello[4] != VERSION:
            raise RecoveryError(f"{_name(addr)} is not an islands recovery server of version {VERSION}")
        self.sock.sendall(_proof(secret, hello[5:]))
        try:
            ok = _recv_exact(self.sock, 1)
        except ConnectionError:
            ok = b""
        if ok != b"\x01":
            raise PermissionError(f"{_name(addr)} refused this joiner: its secret (the job's token) does not match")

    def manifest(self) -> Manifest:
        self.sock.sendall(_REQ.pack(b"M", 0))
        (n,) = _LEN.unpack(_recv_exact(self.sock, 8))
        return Manifest.from_bytes(_recv_exact(self.sock, n))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class _Queue:
    """The chunks still to fetch, shared by the peers' threads; a peer that failed a chunk gets it again only
    when every live peer has failed it."""

    def __init__(self, chunks: int, attempts: int):
        self.todo = collections.deque(range(chunks))
        self.left = chunks
        self.attempts, self.tries = attempts, [0] * chunks
        self.bad: dict[int, set[str]] = {}
        self.live: set[str] = set()
        self.error: str | None = None
        self.cond = threading.Condition()

    def take(self, peer: str, block: bool) -> int | None:
        """An index for `peer`, or None when all is done, an error stopped it, or (block False) none is free now."""
        with self.cond:
            while True:
                if self.error or self.left == 0:
                    return None
                for i in self.todo:
                    failed: set[str] | frozenset[str] = self.bad.get(i, frozenset())
                    if peer not in failed or self.live <= failed:
                        self.todo.remove(i)
                        self.tries[i] += 1
                        return i
                if not block:
                    return None
                self.cond.wait(0.05)

    def done(self, index: int) -> None:
        with self.cond:
            self.left -= 1
            self.cond.notify_all()

    def damaged(self, index: int, peer: str) -> None:
        with self.cond:
            self.bad.setdefault(index, set()).add(peer)
            if self.tries[index] >= self.attempts:
                self.error = (
                    f"chunk {index} arrived damaged {self.tries[index]} times (from "
                    f"{', '.join(sorted(self.bad[index]))}); giving up after {self.attempts} attempts"
                )
            else:
                self.todo.appendleft(index)
            self.cond.notify_all()

    def give_back(self, indices, peer: str, why: str) -> None:
        """A peer's connection broke: its outstanding chunks go back (not counted as attempts)."""
        with self.cond:
            for i in indices:
                self.tries[i] -= 1
                self.todo.appendleft(i)
            self.live.discard(peer)
            if not self.live and self.left and not self.error:
                self.error = f"every peer failed before the state was whole (last: {peer}: {why})"
            self.cond.notify_all()


def fetch_state(
    peers,
    *,
    secret: bytes | None = None,
    expect_digest: str | None = None,
    timeout: float = 30.0,
    attempts: int = ATTEMPTS,
    depth: int = DEPTH,
    manifest_timeout: float | None = None,
    decode=None,
) -> tuple[object, FetchReport]:
    """Fetch a state from `peers` ("host:port" or (host, port), all serving the same snapshot).

    Returns (the tree, a FetchReport). The manifest comes from the first peer that answers, or must have
    `expect_digest` when given (a peer serving another state is skipped; if none serves it: RecoveryError).
    `timeout`: seconds a connection may stay silent before its peer counts as failed. `decode`: for a state the
    peers built with a codec, islands.checkpoint.codec.decode_tensor (checks each blob again). Raises RecoveryError
    when the state cannot be received whole; nothing partial is ever returned.
    """
    addrs = [_addr(p) for p in peers]
    if not addrs:
        raise ValueError("fetch_state needs at least one peer")
    if attempts < 1 or depth < 1:
        raise ValueError(f"attempts and depth must be >= 1; got attempts={attempts}, depth={depth}")
    report = FetchReport()
    start = time.perf_counter()
    conns: list[tuple[_Conn, Manifest]] = []
    manifest: Manifest | None = None
    for addr in addrs:
        try:
            c = _Conn(addr, secret, manifest_timeout or timeout)
            m = c.manifest()
        except (OSError, ConnectionError, RecoveryError) as exc:
            report.skipped[_name(addr)] = f"{type(exc).__name__}: {exc}"
            continue
        conns.append((c, m))
        if manifest is None and (expect_digest is None or m.digest == expect_digest):
            manifest = m
    if manifest is None:
        for c, _ in conns:
            c.close()
        served = sorted({m.digest[:16] for _, m in conns})
        if expect_digest is not None and served:
            raise RecoveryError(
                f"manifest mismatch: the peers serve state {', '.join(served)}..., not the expected "
                f"{expect_digest[:16]}...; they hold another state than the one announced"
            )
        raise RecoveryError(f"no peer answered with a manifest: {report.skipped}")
    use = []
    for c, m in conns:
        if m.digest == manifest.digest:
            use.append(c)
        else:
            report.skipped[_name(c.addr)] = f"serves another state ({m.digest[:16]}... not {manifest.digest[:16]}...)"
            c.close()
    report.digest, report.payload_bytes, report.chunks = manifest.digest, manifest.total, manifest.chunks
    payload = bytearray(manifest.total)
    view = memoryview(payload)
    queue = _Queue(manifest.chunks, attempts)
    queue.live = {_name(c.addr) for c in use}
    lock = threading.Lock()

    def run(conn: _Conn) -> None:
        name = _name(conn.addr)
        stats: dict[str, Any] = {"chunks": 0, "bytes": 0, "damaged": 0, "error": None}  # counts; the error's text
        with lock:
            report.per_peer[name] = stats
        inflight: collections.deque[int] = collections.deque()
        try:
            while True:
                while len(inflight) < depth:  # keep `depth` requests in flight; block only when none is
                    i = queue.take(name, block=not inflight)
                    if i is None:
                        break
                    inflight.append(i)  # before sending: a send that fails gives it back too
                    conn.sock.sendall(_REQ.pack(b"C", i))
                if not inflight:
                    return
                i = inflight[0]
                begin, end = manifest.span(i)
                (n,) = _LEN.unpack(_recv_exact(conn.sock, 8))
                if n != end - begin:
                    raise RecoveryError(f"sent {n} bytes for chunk {i}, which has {end - begin}")
                _recv_into(conn.sock, view[begin:end])
                inflight.popleft()
                if xxhash.xxh3_64_intdigest(view[begin:end]) == manifest.checksums[i]:
                    stats["chunks"] += 1
                    stats["bytes"] += n
                    queue.done(i)
                else:
                    stats["damaged"] += 1
                    with lock:
                        report.refetched += 1
                    queue.damaged(i, name)
        except (OSError, ConnectionError, RecoveryError, struct.error) as exc:
            why = f"{type(exc).__name__}: {exc}"
            stats["error"] = why
            queue.give_back(list(inflight), name, why)
        finally:
            conn.close()

    threads = [threading.Thread(target=run, args=(c,), name="islands-recovery-fetch", daemon=True) for c in use]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if queue.error or queue.left:
        raise RecoveryError(
            f"live recovery of state {manifest.digest[:16]}... failed: "
            f"{queue.error or f'{queue.left} chunks missing'}; per peer: {report.per_peer}"
        )
    state = rebuild(manifest, payload, decode)
    report.seconds = time.perf_counter() - start
    return state, report
