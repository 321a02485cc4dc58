"""The commit protocol of an elastic job (islands.runtime.elastic): how one numbered operation, a collective or an
epoch's connect, commits on every member or on none.

Each member watches its local part (`watch`: a gloo error, a dead/<name> flag from a supervisor, a heartbeat
stale past the heartbeat timeout, or another member's "fail" verdict end the wait), then signs its own
<key>/ok/<name>; one that sees all of them sets the verdict <key>/done "ok" by compare-and-set, anyone who sees a
failure first sets "fail" (compare-and-set: exactly one verdict wins). The store is an AuthStore
(islands.runtime.elastic.auth): values written without the job token are not seen. `Commit` is shared by the collectives
(islands.runtime.elastic.comm.ElasticComm) and the epochs they form (islands.runtime.elastic.epochs.Epochs).

What a watch waits on is pollable like a gloo work (`is_completed`, `wait`): a work itself, or a blocking call on
a thread of its own (`OnThread`: a group being connected, point-to-point works gloo does not report by polling).
"""

from __future__ import annotations

import datetime as _dt
import threading
import time
from collections.abc import Callable
from typing import Any

from islands.runtime.elastic.membership import Liveness


class Commit:
    """One member's side of the commit protocol (module docstring), over the job's store."""

    POLL = 0.005  # seconds between checks of a running collective (store round trip is ~0.2 ms)

    def __init__(self, store, name: str, liveness: Liveness, timeout: float):
        self.store, self.name, self.liveness, self.timeout = store, name, liveness, timeout
        self.POLL = max(self.POLL, store_attr(store, "poll_interval", 0.0))  # an etcd store asks for fewer reads

    def verdict(self, key: str) -> bytes | None:
        return self.store.get(f"{key}/done") if self.store.check([f"{key}/done"]) else None

    def fail(self, key: str) -> None:
        try:
            self.store.compare_set(f"{key}/done", "", "fail")
        except RuntimeError:  # the key keeps being overwritten from outside (AuthStore): commit gives up in time
            pass

    def peer_gone(self, names: list[str]) -> bool:
        others = [n for n in names if n != self.name]
        return bool(self.liveness.gone(others))

    def watch(self, work, key: str, names: list[str]) -> bool:
        """Wait for the local part of a collective; False as soon as any of `names` is known to have failed."""
        deadline = time.monotonic() + self.timeout
        last_live = 0.0
        while not work.is_completed():
            now = time.monotonic()
            if now > deadline or self.verdict(key) == b"fail":
                return False
            if now - last_live > 0.1:
                last_live = now
                if self.peer_gone(names):
                    return False
            time.sleep(self.POLL)
        try:
            work.wait()
        except RuntimeError:
            return False
        return True

    def commit(self, key: str, names: list[str]) -> bool:
        # each member signs its own "ok" (a shared counter could be bumped from outside the job); whoever
        # sees all of them sets the verdict: the last to write its own sees the others'
        self.store.set(f"{key}/ok/{self.name}", "1")
        if self.store.check([f"{key}/ok/{n}" for n in names]):
            self.store.compare_set(f"{key}/done", "", "ok")
        deadline = time.monotonic() + self.timeout
        last_live = 0.0
        while (verdict := self.verdict(key)) is None:
            now = time.monotonic()
            if now > deadline + self.timeout:
                return False  # no genuine verdict could be set (the store is being tampered with): fail over
            if now > deadline:
                self.fail(key)
            elif now - last_live > 0.1:
                last_live = now
                if self.peer_gone(names):
                    self.fail(key)
            time.sleep(self.POLL / 5)
        return verdict == b"ok"


def store_layers(store):
    """`store` and the stores under its wrappers (AuthStore.inner, PrefixStore.underlying_store), outermost first."""
    for _ in range(8):
        if store is None:
            return
        yield store
        store = getattr(store, "inner", None) or getattr(store, "underlying_store", None)


def store_attr(store, name: str, default):
    """An attribute of the first store under `store`'s wrappers that has it."""
    return next((getattr(s, name) for s in store_layers(store) if hasattr(s, name)), default)


class OnThread:
    """A blocking call run on a thread of its own, pollable like a gloo work (`is_completed`, `wait`), so
    `Commit.watch` can wait on it and still see a death. A RuntimeError of the call (a peer died, refused or timed
    out; torch's DistError is one) is raised by `wait`; `_finish` receives the call's result."""

    def __init__(self, call: Callable[[], Any], name: str):
        self._error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(call,), daemon=True, name=name).start()

    def _run(self, call) -> None:
        try:
            self._finish(call())
        except RuntimeError as e:
            self._error = e
        finally:
            self._done.set()

    def _finish(self, result) -> None:
        pass

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


class Connecting(OnThread):
    """A gloo group being built (its constructor blocks until every rank connected). When the builder gives up on
    it (`abandon`), a group that connects after all is aborted, not leaked."""

    def __init__(self, build: Callable[[], Any]):
        self.pg: Any = None  # what `build` made (a gloo ProcessGroup), once it connected and was not abandoned
        self._lock = threading.Lock()
        self._abandoned = False
        super().__init__(build, "islands-connect")

    def _finish(self, pg) -> None:
        with self._lock:
            if self._abandoned:
                quiet_abort(pg)
            else:
                self.pg = pg

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            pg, self.pg = self.pg, None
        if pg is not None:
            threading.Thread(target=quiet_abort, args=(pg,), daemon=True).start()


class Waited(OnThread):
    """Works whose completion gloo does not report by polling (point-to-point send/recv: `is_completed` stays
    False until `wait`), waited on in turn, each up to `timeout_s`: gloo's point-to-point ops otherwise keep the
    group's connect timeout (set_timeout does not reach them), which a large message on a slow link outlasts."""

    def __init__(self, works: list, keep=None, timeout_s: float | None = None):
        self._keep = keep  # the tensors must outlive the works
        bound = None if timeout_s is None else _dt.timedelta(seconds=timeout_s)
        super().__init__(lambda: [w.wait(bound) if bound is not None else w.wait() for w in works], "islands-p2p")


def quiet_abort(pg) -> None:
    try:
        pg.abort()
    except RuntimeError:
        pass
