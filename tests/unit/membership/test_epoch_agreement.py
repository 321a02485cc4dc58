"""Who enters an epoch that candidates form among themselves (Epochs._agree; the first epoch of islands that are
separate jobs): a candidate still starting is waited for, a silent or dead one is not."""

from __future__ import annotations

import json
import threading
import time

from harness.dict_store import DictStore
from islands.runtime.elastic.commit import Commit
from islands.runtime.elastic.epochs import Epochs
from islands.runtime.elastic.membership import Liveness

HEARTBEAT_S = 0.2


def _agreeing(store: DictStore, candidates: list[list], timeout: float) -> tuple[threading.Thread, dict]:
    epochs = Epochs(store, "a", Commit(store, "a", Liveness(store, HEARTBEAT_S), timeout))
    store.set("e/0/reg/a", "1")
    store.set("hb/a", "1")
    seen: dict = {}
    thread = threading.Thread(target=lambda: seen.update(members=epochs._agree(0, candidates)), daemon=True)
    thread.start()
    return thread, seen


def test_a_candidate_that_never_beat_is_waited_for_past_the_heartbeat_timeout_and_a_silent_one_is_not():
    """b has not started beating yet (its framework still importing), c beat once and fell silent: epoch 0 waits
    for b well past the heartbeat timeout, and is formed with b and without c once b registers."""
    store = DictStore()
    store.set("hb/c", "1")
    thread, seen = _agreeing(store, [[0, "a", 0], [1, "b", 1], [2, "c", 2]], timeout=30.0)
    time.sleep(5 * HEARTBEAT_S)
    assert thread.is_alive() and not store.check(["e/0/members"])  # b is not counted gone for its missing beats
    store.set("hb/b", "1")
    store.set("e/0/reg/b", "1")
    thread.join(10)
    assert not thread.is_alive()
    assert [m[1] for m in seen["members"]] == ["a", "b"]
    assert json.loads(store.get("e/0/members")) == seen["members"]


def test_a_candidate_that_never_beat_is_left_out_at_once_when_flagged_dead_or_at_the_deadline():
    store = DictStore()
    store.set("dead/b", "failed")  # its launcher saw its job fail while starting (islands.runtime.cross.mark_gone)
    thread, seen = _agreeing(store, [[0, "a", 0], [1, "b", 1]], timeout=30.0)
    thread.join(10)
    assert not thread.is_alive() and [m[1] for m in seen["members"]] == ["a"]
    store = DictStore()  # never started, never flagged: the commit timeout ends the wait
    started = time.monotonic()
    thread, seen = _agreeing(store, [[0, "a", 0], [1, "b", 1]], timeout=1.0)
    thread.join(10)
    assert [m[1] for m in seen["members"]] == ["a"] and time.monotonic() - started >= 1.0
