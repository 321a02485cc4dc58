"""The parameter server's report of what its servers did (ps_report.py), in one process: the thread mode's server
loop measures its own thread's CPU and its state's bytes and reaches the run record through the Stack (`Reports`);
process mode's shard servers (threads here, harness.ps.ThreadService) publish their numbers in the store, collected
and summed per shard; a process that left no final report, or a supervisor that wrote none, is said to be missing,
not counted as zero."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from test_ps_service import config, push
from test_ps_strategy import Island

from harness.dict_store import DictStore
from harness.ps import ThreadService
from islands.outer import ParameterServer
from islands.runtime.world import World
from islands.sync.base import Reports, capability
from islands.sync.ddp import DDP
from islands.sync.outer.ps import outer_rule
from islands.sync.outer.ps_link import Message
from islands.sync.outer.ps_report import (
    MEMORY_RSS,
    MEMORY_STATE,
    collect,
    hand_over,
    process_report,
    report_taken,
    take_report,
)
from islands.sync.outer.ps_wire import DONE, StoreCalls
from islands.sync.stack import Stack


def test_the_thread_modes_report_counts_its_pushes_and_measures_its_thread_and_state():
    strategy = ParameterServer(inner_steps=3, rule=outer_rule("delayed-nesterov", 0.7, 0.9, 2))
    assert capability(Stack(DDP(), strategy), Reports) is strategy  # how the trainer finds it for run.json
    island = Island(World.single(), strategy)
    for i in range(7):
        island.step(i)
    strategy.finish(island.model)
    section = strategy.run_report()["parameter_server"]
    assert section["mode"] == "thread" and section["complete"] and section["missing"] is None
    (server,) = section["servers"]
    assert server["pushes_received"] == strategy.counts["pushes"] == 3  # 3 + 3 + the last 1 step
    assert server["pushes_applied"] == 3 and server["pushes_refused"] == 0 and server["windows_stepped"] == 3
    assert server["goodput"] == 1.0 and server["duplicates"] == 0
    assert 0 < server["cpu_seconds"] == section["cpu_seconds"]
    numel = strategy.global_flat.numel()
    # the model's fp32 values, delayed Nesterov's momentum and accumulated deltas, one delta in the window at once
    assert server["state_bytes"] == {
        "model": 4 * numel,
        "optimizer": 8 * numel,
        "window_peak": 4 * numel,
        "total": 16 * numel,
    }
    assert server["peak_memory_bytes"] == 16 * numel and server["peak_memory"] == MEMORY_STATE
    assert section["restarts"] is None  # a thread is not restarted


def test_shard_servers_publish_their_numbers_and_the_collection_sums_them_per_shard(tmp_path):
    service = ThreadService(tmp_path, config(servers=2, islands=1))
    a = service.link(0)
    for v in (1.0, 2.0):
        assert push(a, v).ack.accepted
    a.send(Message(DONE, 0))
    service.stop()  # each server publishes its final report as it leaves
    section = process_report(collect(service.store, 2, [0, 3], "test"))
    assert section["mode"] == "processes" and section["complete"] and section["restarts"] == 3
    assert [s["parameters"] for s in section["servers"]] == [[0, 5], [5, 10]]
    for server in section["servers"]:
        assert server["pushes_received"] == server["pushes_applied"] == server["windows_stepped"] == 2
        assert server["complete"] and server["cpu_seconds"] > 0 and server["peak_memory_bytes"] > 0
        assert server["peak_memory"] == MEMORY_RSS and server["state_bytes"]["model"] == 5 * 4


def _process(gen: int, final: bool, cpu: float, pushes: int) -> dict:
    counts = dict(pushes_received=pushes, pushes_applied=pushes, pushes_refused=0, windows_stepped=pushes)
    return dict(
        gen=gen,
        pid=100 + gen,
        final=final,
        parameters=[0, 10],
        cpu_seconds=cpu,
        startup_cpu_seconds=1.0,
        startup_max_rss_bytes=500,
        max_rss_bytes=1000 * gen,
        duplicates=1,
        samples_accepted=1.0,
        samples_refused=0.0,
        goodput=1.0,
        **counts,
    )


def test_a_restarted_shard_sums_its_processes_and_a_missing_report_says_so():
    collected = {
        "stop": "done",
        "supervisor": {},
        "shards": [
            # generation 1 was killed (its last heartbeat's numbers), 2 never reported, 3 left with its final report
            {
                "shard": 0,
                "restarts": 2,
                "processes": [_process(3, True, 2.0, 9), _process(1, False, 3.0, 4)],
                "absent": [2],
            },
            {"shard": 1, "restarts": 0, "processes": [], "absent": [1]},
        ],
    }
    section = process_report(collected)
    first, second = section["servers"]
    assert first["cpu_seconds"] == 5.0 and first["peak_memory_bytes"] == 3000 and first["duplicates"] == 2
    assert first["pushes_applied"] == 9 and first["restarts"] == 2 and not first["complete"]
    assert second["cpu_seconds"] is None and second["peak_memory_bytes"] is None and "pushes_applied" not in second
    assert not section["complete"] and section["cpu_seconds"] is None
    for words in (
        "generation 2 published no report",
        "process 101 (generation 1) ended without",
        "no report from shard 1",
    ):
        assert words in section["missing"]
    gone = process_report(None, "the supervisor did not stop within 600 s and was killed")
    assert not gone["complete"] and gone["servers"] == [] and gone["cpu_seconds"] is None
    assert gone["missing"] == "the supervisor did not stop within 600 s and was killed"


class _Beats(DictStore):
    """The service's store in a dict, with the counter islands bump as they beat."""

    def add(self, key: str, amount: int) -> int:
        value = int(self.kv.get(key, b"0")) + amount
        self.set(key, str(value))
        return value


class _Clock:
    """A clock that moves only when hand_over sleeps; `beating(t)`: whether some island beats at time t."""

    def __init__(self, store: _Beats, beating):
        self.t, self.store, self.beating = 0.0, store, beating

    def now(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        self.t += dt
        if self.beating(self.t):
            self.store.add("beats", 1)


def _calls(call, timeout_s):  # ps_wire.StoreCalls' shape, without a thread
    return call()


def test_an_elastic_supervisor_hands_its_report_over_and_stays_while_an_island_beats():
    store = _Beats()
    collected = {
        "stop": "done",
        "supervisor": {},
        "shards": [{"shard": 0, "restarts": 0, "processes": [_process(1, True, 2.0, 9)], "absent": []}],
    }
    clock = _Clock(store, beating=lambda t: t < 3.0)  # an island that reaches its end late beats until t = 3 s
    why_left = hand_over(store, collected, idle_s=1.0, limit_s=60.0, clock=clock.now, sleep=clock.sleep)
    assert 4.0 <= clock.t < 4.2  # held while it beat, then idle_s more: a killed island (no beats) is not waited for
    assert why_left == "no island beat for 1 s; not taken by island(s) []", why_left  # no finals recorded here
    taken, why = take_report(_calls, store, timeout_s=1.0, call_s=1.0)
    assert why is None and process_report(taken, why)["servers"][0]["pushes_applied"] == 9
    # an island that never stops beating does not keep it for ever
    clock = _Clock(store, beating=lambda t: True)
    why_left = hand_over(store, None, idle_s=1.0, limit_s=10.0, clock=clock.now, sleep=clock.sleep)
    assert 10.0 <= clock.t < 10.2 and why_left == "10 s passed; not taken by island(s) []", why_left
    taken, why = take_report(_calls, store, timeout_s=1.0, call_s=1.0)  # the supervisor wrote none: it says so
    assert taken is None and not process_report(taken, why)["complete"] and why == "the supervisor wrote no report"


def test_an_elastic_supervisor_leaves_once_every_island_answered_final_has_taken_the_report():
    store = _Beats()
    # shard 0 restarted: its first process answered island 0 final, its second island 2 (a restarted island 0)
    first, second = dict(_process(1, False, 1.0, 4), finals=[0]), dict(_process(2, True, 2.0, 9), finals=[2])
    collected = {
        "stop": "done",
        "supervisor": {},
        "shards": [{"shard": 0, "restarts": 1, "processes": [first, second], "absent": []}],
    }

    def beating(t: float) -> bool:  # island 0 takes it at 1 s, island 2 at 2 s; a third island beats all along
        for island, when in ((0, 1.0), (2, 2.0)):
            if t >= when:
                report_taken(_calls, store, island, call_s=1.0)
        return True

    clock = _Clock(store, beating)
    why_left = hand_over(store, collected, idle_s=1.0, limit_s=60.0, clock=clock.now, sleep=clock.sleep)
    assert why_left == "every island answered final took the report (2)", why_left
    assert 2.0 <= clock.t < 2.2  # not at 1 s (island 2 had not taken it), not at the limit (the beats go on)

    # island 2 killed after its final answer: it never takes the report, and the line names it
    store = _Beats()

    def only_island_0(t: float) -> bool:
        if t >= 1.0:
            report_taken(_calls, store, 0, call_s=1.0)
        return t < 1.5

    clock = _Clock(store, only_island_0)
    why_left = hand_over(store, collected, idle_s=1.0, limit_s=60.0, clock=clock.now, sleep=clock.sleep)
    assert why_left == "no island beat for 1 s; not taken by island(s) [2]", why_left


def test_an_island_takes_no_report_within_its_bounds_and_says_why():
    start = time.monotonic()
    taken, why = take_report(_calls, _Beats(), timeout_s=0.3, call_s=1.0)  # nothing handed over
    assert taken is None and "handed over no report within 0 s" in why and time.monotonic() - start < 5

    def gone(call, timeout_s):  # the supervisor has ended: nothing listens at the store's address
        raise RuntimeError("Connection reset by peer")

    taken, why = take_report(gone, _Beats(), timeout_s=60.0, call_s=1.0)
    assert taken is None and "could not be taken from the service's store: Connection reset" in why
    stopped = threading.Event()  # a SIGSTOPped supervisor's store: a call that never returns
    silent = StoreCalls("127.0.0.1:1")
    start = time.monotonic()
    taken, why = take_report(silent, SimpleNamespace(check=lambda keys: stopped.wait()), timeout_s=60.0, call_s=0.2)
    stopped.set()
    assert taken is None and "did not answer within 0 s" in why and time.monotonic() - start < 5
