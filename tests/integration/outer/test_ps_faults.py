"""The parameter server's processes under faults (issue #36, part 2). Processes, because what is tested is what a
signal does to a process: a shard server SIGKILLed mid-run (its supervisor starts it again from its journal), an
island SIGSTOPped (its connection and heartbeat freeze, nothing errors) and then SIGKILLed. One scenario, one server
process and one island process (forked from the preloaded forkserver, no interpreter start-up), the other island a
thread of the test: no acknowledged push is lost, none is applied twice, and nobody waits for the frozen island."""

from __future__ import annotations

import os
import queue
import signal
import time

import torch

from harness.procs import mp_context
from harness.ps import ForkedShard, pushing_island
from islands.sync.outer.ps import OuterRule
from islands.sync.outer.ps_link import Message
from islands.sync.outer.ps_remote import RemoteLink
from islands.sync.outer.ps_report import process_report, read_collected
from islands.sync.outer.ps_service import ServiceConfig, Supervisor
from islands.sync.outer.ps_wire import DONE, LEAVE, PULL, PUSH

LEASE = 3.0  # generous: a loaded 2-core machine can starve a heartbeat thread for a second


def drain(q) -> list[int]:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def wait_for(cond, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.05)


def test_a_killed_server_loses_no_acknowledged_push_and_a_frozen_island_blocks_nobody(tmp_path):
    config = ServiceConfig(torch.zeros(6), OuterRule("sgd", 1.0, 0.0), islands=2, max_staleness=10**6, lease_s=LEASE)
    config.save(tmp_path)
    supervisor = Supervisor(tmp_path, starter=ForkedShard).start()
    address = ("127.0.0.1", supervisor.port)
    ctx = mp_context()
    acked = ctx.Queue()
    b = ctx.Process(target=pushing_island, args=(address, 1, config.bounds, LEASE, acked), daemon=True)
    b.start()
    a = RemoteLink(address, 0, config.bounds, timeout_s=120.0, lease_s=LEASE).start()
    try:
        a.send(Message(PULL, 0))
        b_acked: list[int] = []

        def island_1_acked(n: int) -> None:
            def enough() -> bool:
                b_acked.extend(drain(acked))
                return len(b_acked) >= n

            wait_for(enough, f"{n} pushes of island 1")

        for k in (1, 2, 3):
            a.send(Message(PUSH, 0, 0, 1.0, torch.full((6,), float(k))))
        island_1_acked(2)

        os.kill(supervisor.pid(0), signal.SIGKILL)  # the server dies with whatever it had in flight
        for k in (4, 5, 6):  # answered by its successor, rebuilt from the journal
            assert a.send(Message(PUSH, 0, 0, 1.0, torch.full((6,), float(k)))).ack.accepted
        assert supervisor.restarts == [1] and a.retries >= 1
        island_1_acked(len(b_acked) + 1)  # island 1 found the new server too

        os.kill(b.pid, signal.SIGSTOP)  # frozen: no error anywhere, its heartbeat just stops
        b_acked += drain(acked)
        a.send(Message(PUSH, 0, 0, 1.0, torch.full((6,), 7.0)))
        started = time.monotonic()
        final = a.send(Message(DONE, 0))  # answered once island 1's lease lapses, not when it wakes up
        assert a.final and time.monotonic() - started < 60.0
        os.kill(b.pid, signal.SIGKILL)  # killed while frozen: nothing hangs on it either
        b.join(30)
        b_acked += drain(acked)

        # every acknowledged push of both islands is in the model exactly once; island 1 may have had one more
        # applied whose answer it never saw (frozen between the server's answer and its report)
        n = len(b_acked)
        assert b_acked == list(range(1, n + 1))
        a_sum = sum(range(1, 8))
        allowed = [-(a_sum + sum(100 + k for k in range(1, m + 1))) for m in (n, n + 1)]
        assert final.flat.unique().tolist() in ([allowed[0]], [allowed[1]]), (final.flat, allowed)
    finally:
        a.close()
        if b.is_alive():
            os.kill(b.pid, signal.SIGKILL)
        supervisor.stop(60.0)
    assert supervisor.stopped.is_set() and supervisor.procs[0] is not None and supervisor.procs[0].poll() is not None
    # its report (ps_report.py): the killed process's numbers as of its last heartbeat, said to be so; its successor's
    # final ones; both processes' CPU summed; the restart counted; every push applied counted once
    report = process_report(read_collected(tmp_path))
    (shard,) = report["servers"]
    killed, successor = shard["processes"]
    assert shard["restarts"] == report["restarts"] == 1 and not killed["final"] and successor["final"]
    assert not report["complete"] and "(generation 1) ended without its final report" in report["missing"]
    assert shard["cpu_seconds"] == killed["cpu_seconds"] + successor["cpu_seconds"] > 0
    assert shard["pushes_applied"] == 7 + n + (final.flat[0].item() == allowed[1])  # island 1's unseen one too


def test_a_killed_shard_0_answers_with_the_buffer_mean_it_held(tmp_path):
    """A BatchNorm model's buffers survive shard 0's SIGKILL: each acknowledged push's buffer vector is in the push's
    journal record, so the successor answers a new island's pull with the two islands' mean at once, bit for bit
    (before, with none until the islands pushed again)."""
    rule = OuterRule("sgd", 1.0, 0.0)
    config = ServiceConfig(torch.zeros(6), rule, islands=2, max_staleness=100, lease_s=LEASE, buffers=(2, 1))
    config.save(tmp_path)
    supervisor = Supervisor(tmp_path, starter=ForkedShard).start()
    address = ("127.0.0.1", supervisor.port)
    links = [RemoteLink(address, i, config.bounds, timeout_s=120.0, lease_s=LEASE, buffers=3).start() for i in range(3)]
    try:
        a, b, late = links
        va = torch.tensor([1.5, -2.25, 4.0], dtype=torch.float64)  # two statistics, then a count
        vb = torch.tensor([0.5, 6.75, 9.0], dtype=torch.float64)
        assert a.send(Message(PUSH, 0, 0, 1.0, torch.ones(6), va)).ack.accepted
        mean = b.send(Message(PUSH, 1, 0, 1.0, torch.ones(6), vb)).buffers
        assert mean is not None and mean.tolist() == [1.0, 2.25, 9.0]  # the floating values' mean, the largest count
        os.kill(supervisor.pid(0), signal.SIGKILL)
        wait_for(lambda: int(supervisor.store.add("gen/0", 0)) == 2, "shard 0's successor")
        pulled = late.send(Message(PULL, 2))
        assert supervisor.restarts == [1] and pulled.flat.tolist() == [-2.0] * 6
        assert pulled.buffers is not None and torch.equal(pulled.buffers, mean)
        late.send(Message(LEAVE, 2))  # the only island the successor has met: it may leave at the stop
    finally:
        for link in links:
            link.close()
        supervisor.stop(60.0)
    assert supervisor.stopped.is_set()


def _start_service_and_wait(directory, ends_with_starter: bool, pids) -> None:
    """The starting island process of a job: writes the configuration, starts the supervisor (a process of its own
    session, as ps.py does), says its pid and waits to be killed."""
    from islands.sync.outer.ps_service import launch

    rule = OuterRule("sgd", 1.0, 0.0)
    config = ServiceConfig(torch.zeros(6), rule, islands=2, lease_s=LEASE, ends_with_starter=ends_with_starter)
    config.save(directory)
    proc, _ = launch(directory)
    pids.put(proc.pid)
    time.sleep(600)


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_fixed_jobs_servers_end_with_the_island_that_started_them_and_an_elastic_jobs_do_not(tmp_path):
    """A fixed job dies with its island 0 (gloo takes the others down too): its supervisor and servers stop within
    seconds instead of waiting out the 600 s orphan timer; an elastic job's outlive the island, which may return."""
    import psutil

    ctx = mp_context()
    supervisors = {}
    for ends in (True, False):
        pids = ctx.Queue()
        starter = ctx.Process(target=_start_service_and_wait, args=(tmp_path / str(ends), ends, pids), daemon=True)
        starter.start()
        supervisor = pids.get(timeout=120)
        wait_for(lambda s=supervisor: len(psutil.Process(s).children()) == 1, "shard server started")
        supervisors[ends] = (supervisor, psutil.Process(supervisor).children()[0].pid)
        os.kill(starter.pid, signal.SIGKILL)
        starter.join()
    try:
        fixed, fixed_server = supervisors[True]
        wait_for(lambda: _gone(fixed) and _gone(fixed_server), "end of the fixed job's service", timeout_s=30)
        elastic, elastic_server = supervisors[False]
        time.sleep(3 * LEASE)  # longer than the fixed job's service took to notice
        assert not _gone(elastic) and not _gone(elastic_server)
    finally:
        for supervisor, server in supervisors.values():
            for pid in (server, supervisor):
                if not _gone(pid):
                    os.kill(pid, signal.SIGKILL)


def test_a_frozen_or_killed_supervisor_hangs_nobody_and_a_new_one_loses_no_acknowledged_push(tmp_path):
    """The supervisor hosts the store, and a TCPStore client waits for ever on a stopped master. SIGSTOPped, its
    server ends by itself within SUPERVISOR_SILENT_S and the island's next push fails within its timeout, naming the
    store, instead of both hanging; a new supervisor on the same directory rebuilds the shard from its journal with
    every acknowledged push once. SIGKILLed, its server ends at once and the island is told the service is gone."""
    import psutil
    import pytest

    from islands.sync.outer.ps_process import main as ps_process
    from islands.sync.outer.ps_remote import ServiceGone
    from islands.sync.outer.ps_service import ADDRESS, SUPERVISOR_SILENT_S

    config = ServiceConfig(torch.zeros(6), OuterRule("sgd", 1.0, 0.0), islands=1, lease_s=LEASE)
    config.save(tmp_path)
    started: list[int] = []
    ctx = mp_context()

    def service():
        """`ps_process supervise DIR`, forked from the preloaded forkserver (its server is a fresh interpreter)."""
        (tmp_path / ADDRESS).unlink(missing_ok=True)
        proc = ctx.Process(target=ps_process, args=(["supervise", str(tmp_path)],), daemon=True)
        proc.start()
        started.append(proc.pid)
        wait_for(lambda: (tmp_path / ADDRESS).exists() and len(psutil.Process(proc.pid).children()) == 1, "a server")
        host, port = (tmp_path / ADDRESS).read_text().strip().rsplit(":", 1)
        return proc, (host, int(port)), psutil.Process(proc.pid).children()[0].pid

    def push(link, value: float):
        return link.send(Message(PUSH, 0, 0, 1.0, torch.full((6,), value)))

    try:
        frozen, address, server = service()
        link = RemoteLink(address, 0, config.bounds, timeout_s=8.0, lease_s=LEASE).start()
        link.send(Message(PULL, 0))
        assert all(push(link, k).ack.accepted for k in (1.0, 2.0, 3.0))
        os.kill(frozen.pid, signal.SIGSTOP)
        wait_for(lambda: _gone(server), "the server to end", timeout_s=SUPERVISOR_SILENT_S + 20)
        started_at = time.monotonic()
        with pytest.raises(TimeoutError, match=r"store at .* (did not|has not) answer"):
            push(link, 100.0)  # reached no server: never applied
        assert time.monotonic() - started_at < 8.0 + 4 * LEASE
        link.close()
        frozen.kill()
        frozen.join(30)

        killed, address, server = service()  # the same directory: the shard rebuilt from its journal
        link = RemoteLink(address, 0, config.bounds, timeout_s=60.0, lease_s=LEASE).start()
        assert link.send(Message(PULL, 0)).flat.tolist() == [-6.0] * 6  # pushes 1-3, each once
        assert push(link, 4.0).flat.tolist() == [-10.0] * 6
        killed.kill()
        killed.join(30)
        wait_for(lambda: _gone(server), "the server to end", timeout_s=10)
        with pytest.raises(ServiceGone):
            push(link, 5.0)
        link.close()
    finally:
        for pid in started:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
