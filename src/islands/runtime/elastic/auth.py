"""An authenticated control plane for elastic jobs: every value in the job's store carries an HMAC.

torch's TCPStore has no access control: any process that reaches its port may read, write and delete
keys. The job token keeps such a process out of the admission handshake (membership.proof), and this
module keeps it out of everything after: a value is written as an envelope

    b"isl1 " + {"s": sender, "n": counter, "m": MAC} + b"\\n" + value
    MAC = HMAC-SHA256(key, json [store key, sender, counter] + NUL + value)

under a key derived from the token and the job's random id (`ControlAuth`). What the MAC binds:
  * the store key the value was written under: a genuine value copied to another key (another epoch's
    members, another operation's verdict, another worker's heartbeat) does not verify there;
  * the job id (through the key): a value captured in an earlier job with the same token does not verify;
  * the sender and a per-sender counter that only grows (max(last + 1, wall clock in ns)): a reader keeps,
    per key, the newest value it accepted and refuses an older one (a replay) written back over it.
`AuthStore` is a torch.distributed Store (Python subclass) over the job's raw store that seals what it
writes and verifies what it reads: a forged, tampered or replayed value reads as absent (or as the last
genuine value this reader accepted for that key), and is counted in `stats` and logged. Because it is a
Store, gloo's own rendezvous (the peers' addresses of every epoch's process group) goes through it too,
so a process without the token cannot point a member at an address of its choosing.

What it cannot stop (docs/membership.md, "Security"): a process that reaches the port can still delete
or overwrite keys, i.e. deny service (members see values vanish and fail over on their timeouts), and
`add` counters (join tickets) stay unauthenticated. Payload tensors travel over gloo's own connections,
not through the store; `mac_payload` is the optional check for bytes sent between islands.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

MAGIC = b"isl1 "
_DOMAIN = b"islands-control-v1|"


def derive_key(token: str, scope: str) -> bytes:
    """The MAC key of one scope ("job" for the job record, the job's id for everything else)."""
    if not token:
        raise ValueError("an authenticated control plane needs a non-empty token")
    return hmac.new(token.encode(), _DOMAIN + scope.encode(), hashlib.sha256).digest()


def _mac(key: bytes, store_key: str, sender: str, counter: int, value: bytes) -> str:
    head = json.dumps([store_key, sender, counter]).encode()  # JSON: no raw NUL, so the split is unambiguous
    return hmac.new(key, head + b"\0" + value, hashlib.sha256).hexdigest()


def _bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, list):  # torch hands some Store values over as a list of ints
        return bytes(value)
    raise TypeError(f"a store value must be str or bytes; got {type(value).__name__}")


class ControlAuth:
    """Seals and opens envelopes for one sender under one key. Thread-safe (a process's heartbeat thread,
    training thread and checkpoint thread share one, so its counter grows across all of them)."""

    def __init__(self, token: str, scope: str, sender: str):
        self.key, self.sender, self.scope = derive_key(token, scope), sender, scope
        self._lock = threading.Lock()
        self._last = 0

    def _next(self) -> int:
        with self._lock:
            # wall-clock based, so that values one key receives from different senders over time still
            # compare by when they were written (a launcher and later epochs' rank 0 both write "latest")
            self._last = max(self._last + 1, time.time_ns())
            return self._last

    def seal(self, store_key: str, value) -> bytes:
        value = _bytes(value)
        n = self._next()
        head = json.dumps({"s": self.sender, "n": n, "m": _mac(self.key, store_key, self.sender, n, value)})
        return MAGIC + head.encode() + b"\n" + value

    def open(self, store_key: str, raw) -> tuple[str, int, bytes] | str:
        """(sender, counter, value) when `raw` verifies under `store_key`, else the reason it does not:
        "unsigned" (no envelope), "malformed", or "bad_mac" (forged, tampered, or moved from another key)."""
        raw = _bytes(raw)
        if not raw.startswith(MAGIC):
            return "unsigned"
        head, sep, value = raw[len(MAGIC) :].partition(b"\n")
        try:
            if not sep:
                raise TypeError  # no header line: malformed, as a missing field is
            h = json.loads(head)
            sender, n, mac = h["s"], h["n"], h["m"]
            if not (isinstance(sender, str) and isinstance(n, int) and isinstance(mac, str)):
                raise TypeError
        except (ValueError, TypeError, KeyError):
            return "malformed"
        if not hmac.compare_digest(mac, _mac(self.key, store_key, sender, n, value)):
            return "bad_mac"
        return sender, n, value


class AuthStore(dist.Store):
    """A Store over `inner` (the job's raw store client) that seals every value it writes and reads only
    values that verify. Per key it keeps the newest value it accepted: an older genuine value written
    back (a replay) is refused and the kept one is returned; so is a forged or tampered one. A key whose
    only value does not verify reads as absent (`check` False; `get`/`wait` keep waiting for a genuine one
    until their timeout). `stats` counts what was accepted and refused; `log` hears about refusals (the
    first few of each reason, then every 100th).

    `add` is passed through unauthenticated: counters cannot carry a MAC (membership uses one only for
    join tickets, whose forgery can only waste a ticket)."""

    LOG_FIRST = 5

    def __init__(
        self,
        inner,
        auth: ControlAuth,
        log: Callable[[str], None] | None = None,
        timeout_s: float = 30.0,
        audit: bool = False,
    ):
        super().__init__()
        self.inner, self.auth, self.log = inner, auth, log
        self.timeout_s = timeout_s
        self._kept: dict[str, tuple[int, bytes, bytes]] = {}  # key -> (counter, raw, value)
        self._fresh: dict[str, bool] = {}  # key -> whether the last read found the kept value in the store
        self._lock = threading.Lock()
        self.stats = {"accepted": 0, "rejected": 0, "unsigned": 0, "malformed": 0, "bad_mac": 0, "replay": 0}
        # audit: audit_digest of each (store key, envelope) accepted -> [when (wall clock, last acceptance), its
        # counter, the counter of the value this reader held for the key before (0: none)], for the
        # control-plane experiment to tell whether anything an outsider wrote was accepted, and how
        self.accepted_digests: dict[str, list] | None = {} if audit else None

    # ---- verification ---------------------------------------------------------------------------
    def _refuse(self, key: str, reason: str) -> None:
        with self._lock:
            self.stats["rejected"] += 1
            self.stats[reason] += 1
            count = self.stats[reason]
        if self.log is not None and (count <= self.LOG_FIRST or count % 100 == 0):
            self.log(
                f"islands: control plane: refused a value of {key!r} ({reason}; {count} so far): "
                "written without the job's token, altered, or replayed"
            )

    def _accept(self, key: str, raw: bytes) -> bytes | None:
        """The value to use for `key` after reading `raw` there, or None when there is none (yet)."""
        raw = _bytes(raw)
        kept = self._kept.get(key)
        self._fresh[key] = False
        if kept is not None and raw == kept[1]:
            self._fresh[key] = True
            return kept[2]
        opened = self.auth.open(key, raw)
        if isinstance(opened, str):
            self._refuse(key, opened)
            return kept[2] if kept is not None else None
        _, n, value = opened
        if kept is not None and n <= kept[0]:
            self._refuse(key, "replay")
            return kept[2]
        self._fresh[key] = True
        with self._lock:
            self._kept[key] = (n, raw, value)
            self.stats["accepted"] += 1
            if self.accepted_digests is not None:
                self.accepted_digests[audit_digest(key, raw)] = [time.time(), n, kept[0] if kept else 0]
        return value

    def fresh(self, key: str) -> bool:
        """Whether the last read of `key` found a genuine value in the store (not an older kept one returned
        because a forged, altered or replayed value was there): Liveness counts only such reads."""
        return self._fresh.get(key, False)

    def _deadline(self, timeout) -> float:
        if isinstance(timeout, _dt.timedelta):
            timeout = timeout.total_seconds()
        return time.monotonic() + (self.timeout_s if timeout is None else float(timeout))

    # ---- the Store interface ----------------------------------------------------------------------
    def set(self, key: str, value) -> None:
        self.inner.set(key, self.auth.seal(key, value))

    def get(self, key: str) -> bytes:
        deadline = self._deadline(None)
        while True:
            value = self._accept(key, self.inner.get(key))
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no authenticated value for store key {key!r} within {self.timeout_s:.0f} s "
                    "(only values written without the job's token were there)"
                )
            time.sleep(0.01)

    def check(self, keys) -> bool:
        if not self.inner.check(list(keys)):
            return False
        return all(self._accept(k, self.inner.get(k)) is not None for k in keys)

    def wait(self, keys, timeout=None) -> None:
        deadline = self._deadline(timeout)
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no authenticated value for store keys {list(keys)} in time")
            time.sleep(0.005)

    def compare_set(self, key: str, expected, desired) -> bytes:
        """Create-if-absent only (expected ""): a key already holding a value that does not verify is
        replaced by compare-and-set against exactly that value, so a value planted in advance cannot
        block a write-once key; between honest writers exactly one value still wins."""
        if _bytes(expected):
            raise ValueError("AuthStore.compare_set supports only expected='' (create if absent)")
        sealed = self.auth.seal(key, desired)
        current = self.inner.compare_set(key, b"", sealed)
        for _ in range(8):  # an attacker racing us each time only denies service; bounded
            value = self._accept(key, current)
            if value is not None:
                return value
            current = self.inner.compare_set(key, _bytes(current), sealed)
        raise RuntimeError(f"store key {key!r} keeps being overwritten without the job's token")

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def delete_key(self, key: str) -> bool:
        with self._lock:
            self._kept.pop(key, None)
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def snapshot(self) -> dict:
        """What this reader accepted and refused (for run records and the control-plane experiment)."""
        with self._lock:
            return dict(self.stats)


def audit_digest(store_key: str, raw: bytes) -> str:
    """Names one value written under one key (the audit of AuthStore and the control-plane experiment)."""
    return hashlib.sha256(store_key.encode() + b"\0" + _bytes(raw)).hexdigest()[:24]


def mac_payload(key: bytes, data) -> bytes:
    """HMAC-SHA256 of a payload buffer (bytes, or a contiguous CPU tensor's bytes): the optional check on
    bytes exchanged between islands; its cost is measured by `islands bench control-plane`."""
    view = memoryview(data.numpy()) if hasattr(data, "numpy") else memoryview(data)
    return hmac.new(key, view.cast("B"), hashlib.sha256).digest()
