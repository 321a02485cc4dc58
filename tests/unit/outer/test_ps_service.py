"""The parameter server's shard servers and island links in one process (issue #36, parts 2-4): shard servers run as
threads here (harness.ps.ThreadService), over the same store and gloo pairs as the processes of a job. Parameter
ranges over two servers with sealed messages, a joiner and a leaver that nobody waits for, an island gone silent
(its heartbeat stops) that stops counting for the quorum and the final answer, checkpoint resume through the
servers' snapshot, and bad settings refused."""

from __future__ import annotations

import datetime as _dt
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist
from test_ps_strategy import Island

from harness.cli import islands_cli
from harness.ps import ThreadService
from islands.outer import ParameterServer, VirtualClock
from islands.runtime.elastic.auth import derive_key
from islands.runtime.world import World
from islands.sync.outer.ps import OuterRule, ServerProcesses
from islands.sync.outer.ps_link import Message
from islands.sync.outer.ps_remote import REPLY_BYTES, REQUEST_BYTES, ServiceGone
from islands.sync.outer.ps_service import Members, ServiceConfig
from islands.sync.outer.ps_wire import DONE, LEAVE, PULL, PUSH, Pair, Request, ShardReply

SGD1 = OuterRule("sgd", 1.0, 0.0)  # global -= delta: sums of small integers are exact, whatever the order


def config(**kw) -> ServiceConfig:
    return ServiceConfig(torch.zeros(10), kw.pop("rule", SGD1), **{"lease_s": 30.0, "max_staleness": 100, **kw})


def push(link, value: float, samples: float = 1.0):
    return link.send(Message(PUSH, link.island, 0, samples, torch.full((10,), value)))


def until(cond, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_two_servers_hold_a_parameter_range_each_and_lose_nothing(tmp_path):
    tags = dict(key=derive_key("secret", "payload|ps-test"), domain=b"ps-test|")  # every tensor sealed
    with ThreadService(tmp_path, config(servers=2, islands=2, **tags)) as service:
        a, b = service.link(0), service.link(1)
        for v in (1.0, 2.0, 3.0):
            assert push(a, v).ack.accepted and push(b, 10 * v).ack.accepted
        assert [s.durable.state.numel for s in service.servers] == [5, 5]
        assert [s.durable.state.version for s in service.servers] == [6, 6] and a.versions == [5, 5]
        finals: dict[int, object] = {}
        threads = [
            threading.Thread(target=lambda x=x: finals.__setitem__(x.island, x.send(Message(DONE, x.island))))
            for x in (a, b)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert a.final and b.final
        expected = torch.full((10,), -66.0)  # every push applied once: -(1 + 2 + 3) * 11
        assert torch.equal(finals[0].flat, expected) and torch.equal(finals[1].flat, expected)
        assert (tmp_path / "shard0" / "log.0").exists() and (tmp_path / "shard1" / "log.0").exists()


def test_four_bit_pushes_are_encoded_per_server_range_and_decoded_on_each_server(tmp_path):
    from islands.outer import Quant4
    from islands.runtime.comm import CommLedger

    codec = Quant4(4)
    with ThreadService(tmp_path, config(servers=2, codec=codec)) as service:
        ledger = CommLedger()
        a = service.link(0, codec=codec, ledger=ledger)
        delta = torch.tensor([0.5, -1.0, 2.0, 0.25, 3.0, -3.0, 1.5, 0.0, 0.75, -0.5])
        reply = a.send(Message(PUSH, 0, 0, 1.0, delta))
        # each server decoded its own range's code: the model moved by -delta within the 4-bit bound of each block
        lo, hi = service.config.bounds[0]
        bound = torch.cat([codec.bound(delta[lo:hi]), codec.bound(delta[hi:])])
        assert reply.ack.accepted and bool(((reply.flat + delta).abs() <= bound + 1e-6).all())
        sent = ledger.snapshot()["sent"]["ps_push"] - 2 * REQUEST_BYTES  # two requests' headers
        assert sent == codec.payload_nbytes(5) * 2 < 10 * 4  # 4-bit codes and block scales, not fp32


def test_a_joiner_starts_from_the_global_model_and_a_leaver_is_not_waited_for(tmp_path):
    with ThreadService(tmp_path, config(quorum=2, islands=2)) as service:
        a, b = service.link(0), service.link(1)
        for x in (a, b):  # both join: the quorum counts islands that have joined and not left
            x.send(Message(PULL, x.island))
        assert not push(a, 1.0).ack.stepped  # the window waits for a second island
        assert push(b, 3.0).ack.stepped  # samples-weighted mean of 1 and 3: -2
        assert not push(a, 1.0).ack.stepped
        left = b.send(Message(LEAVE, 1))  # b leaves: the window no longer waits for it
        assert left.ack.stepped and torch.equal(left.flat, torch.full((10,), -3.0))
        c = service.link(2)  # a joiner: starts from the model as it is now, nobody waited for it
        joined = c.send(Message(PULL, 2))
        assert torch.equal(joined.flat, torch.full((10,), -3.0)) and c.versions == [2]
        assert not push(c, 2.0).ack.stepped  # a and c are the quorum now
        assert push(a, 4.0).ack.stepped
        waiting = threading.Thread(target=lambda: a.send(Message(DONE, 0)))
        waiting.start()  # a is done: its final answer waits for c, the one island still training
        until(lambda: service.servers[0].members.state[0] == "done")
        assert not a.final
        done = c.send(Message(DONE, 2))
        waiting.join(60)
        assert c.final and a.final and torch.equal(done.flat, torch.full((10,), -6.0))


class Received:
    """A ledger that keeps the bytes each answer brought."""

    def __init__(self):
        self.pulls: list[int] = []

    def record(self, kind: str, sent: int, received: int) -> None:
        if kind == "ps_pull":
            self.pulls.append(received)


def test_a_done_island_polls_without_the_model_until_the_final_answer(tmp_path):
    """While others train, a done island asks again every 0.5 s; before, each answer carried the whole model (7 MB per
    poll on a 5 Mbit/s link for the byte LM). Now its first DONE and the final answer carry it, the polls do not."""
    with ThreadService(tmp_path, config(islands=2)) as service:
        seen = Received()
        a, b = service.link(0, ledger=seen), service.link(1)
        push(b, 1.0)
        waiting = threading.Thread(target=lambda: a.send(Message(DONE, 0)))
        waiting.start()
        until(lambda: len(seen.pulls) >= 4)  # the first DONE and three polls while b still trains
        done = b.send(Message(DONE, 1))
        waiting.join(60)
        assert a.final and b.final and torch.equal(done.flat, torch.full((10,), -1.0))
        with_model = [n for n in seen.pulls if n == REPLY_BYTES + 10 * 4]  # an answer's header and the fp32 model
        assert len(with_model) == 2 and len(seen.pulls) >= 5, seen.pulls  # the first answer and the final one
        assert all(n in (REPLY_BYTES, REPLY_BYTES + 40) for n in seen.pulls), seen.pulls  # polls: a header


def test_an_island_gone_silent_stops_counting_for_the_quorum_and_the_end(tmp_path):
    # a 3 s lease: a's push must reach the server while b's lease still holds (with 1 s, a full suite's load once
    # delayed it past the lapse, and the window stepped at once)
    with ThreadService(tmp_path, config(quorum=2, islands=2, lease_s=3.0)) as service:
        a, b = service.link(0), service.link(1)
        b.send(Message(PULL, 1))
        b.stopping.set()  # b's heartbeat stops, as a SIGSTOP or a cut cable leaves it: no message, no error
        assert not push(a, 1.0).ack.stepped
        server = service.servers[0]
        until(lambda: server.durable.state.version == 1)  # the lease lapsed: the window stepped without b
        assert server.members.state[1] == "lapsed"
        done = a.send(Message(DONE, 0))
        assert a.final and torch.equal(done.flat, torch.full((10,), -1.0))


def test_an_island_that_wakes_after_the_final_answer_ends_on_the_same_model(tmp_path):
    """A lapsed island that wakes up after another island got its final answer (a frozen host thawed, or a heartbeat
    starved past the lease on a loaded machine: test_ps_elastic once ended its two survivors 7 versions apart). Once a
    shard has answered final, its model is the job's: a later push is not applied (refused) and the woken island's
    DONE is answered final with the very same slice, so every island ends on one model."""
    with ThreadService(tmp_path, config(islands=2, lease_s=2.0)) as service:
        a, b = service.link(0), service.link(1)
        b.send(Message(PULL, 1))
        b.stopping.set()  # b's heartbeat stands still: it lapses after the lease
        push(a, 1.0)
        server = service.servers[0]
        until(lambda: server.members.state[1] == "lapsed")
        final_a = a.send(Message(DONE, 0))
        assert a.final and torch.equal(final_a.flat, torch.full((10,), -1.0))
        late = push(b, 5.0)  # b wakes: its round is over for everyone else
        assert not late.ack.accepted and server.durable.state.version == 1
        final_b = b.send(Message(DONE, 1))
        assert b.final and torch.equal(final_b.flat, final_a.flat)


class StillBeat:
    """A store whose heartbeat counters never move: every island's heartbeat stands still."""

    def add(self, key: str, n: int) -> int:
        return 0


def test_an_island_whose_message_is_on_the_way_does_not_lapse_while_its_heartbeat_stands_behind_it():
    """A push on a slow link takes longer than the lease (7 MB: 2.8 s at 20 Mbit/s), and the heartbeat shares that
    link: from its header to its answer the island is alive; the lease counts again from the answer. Before, the
    server could count the island lapsed mid-push and, with the job stopping, leave without its final answer."""
    members = Members(StillBeat(), lease_s=0.05)
    members.mark(1, "live")
    members.begin(1)  # the header is in; the payload is still coming
    time.sleep(0.15)
    assert members.lapse() == [] and members.state[1] == "live"
    members.end(1)  # answered: the lease starts again now
    assert members.lapse() == [] and members.state[1] == "live"
    time.sleep(0.15)
    assert members.lapse() == [1] and members.state[1] == "lapsed"  # silent after its answer: lapsed as before


def test_the_lease_starts_once_an_answer_can_have_reached_the_island():
    """gloo's send returns when the answer is in this host's socket buffers, not at the island, and the island's
    heartbeat queues behind those bytes: the lease starts after the answer's bytes at the pace the island's last
    large push came in (at 5 Mbit/s ~4 MB of buffered answer is 6 s, past a 2 s lease)."""
    members = Members(StillBeat(), lease_s=0.05)
    members.mark(1, "live")
    members.begin(1)
    members.arrived(1, 1 << 20, 0.5)  # its 1 MiB push took 0.5 s: 2 MiB/s
    members.end(1, answered_bytes=1 << 20)  # a 1 MiB answer: 0.5 s more on the way
    time.sleep(0.3)
    assert members.lapse() == [] and members.state[1] == "live"
    time.sleep(0.4)
    assert members.lapse() == [1]
    members.arrived(2, 1000, 10.0)  # too small to measure a link: no pace, no grace
    assert 2 not in members.rate


def test_an_island_killed_while_it_polls_for_its_final_answer_lapses_and_the_servers_can_leave():
    """A done island polls until every island is done; its heartbeat goes on meanwhile. Killed there, it stayed
    "done" without its final answer for good: `settled` never held, and the servers and their supervisor outlived
    the job (found after the churn bench's byte LM runs, session 38). Now its silence lapses it like a training
    island's; an island that has its final answer is not lapsed by its (stopped) heartbeat."""
    members = Members(StillBeat(), lease_s=0.05)
    for island in (1, 2):
        members.mark(island, "live")
        members.mark(island, "done")
    members.final_sent.add(2)  # island 2 got its final answer and left; island 1 is polling, then killed
    assert not members.settled() and members.lapse() == []  # the server's loop reads the heartbeats
    time.sleep(0.15)
    assert members.lapse() == [1] and members.state == {1: "lapsed", 2: "done"}
    assert members.settled()


def test_a_stopping_server_leaves_only_once_its_final_answers_can_have_arrived():
    """Leaving closes the connections: a final answer (the whole model) still in this host's socket buffers would be
    cut off, so `settled` waits for its bytes at the island's pace."""
    members = Members(StillBeat(), lease_s=30.0)
    members.mark(1, "live")
    members.begin(1)
    members.arrived(1, 1 << 20, 0.4)  # 2.5 MiB/s
    members.end(1, answered_bytes=0)
    members.begin(1)  # its DONE: answered final, the answer still being sent
    members.mark(1, "done")
    members.final_sent.add(1)
    assert not members.settled()
    members.end(1, answered_bytes=1 << 20)  # the final model has left this host: 0.4 s on the way
    assert not members.settled()
    time.sleep(0.5)
    assert members.settled()


def test_an_island_whose_service_has_ended_is_told_at_once_not_after_its_timeout(tmp_path):
    """The store lives as long as the supervisor: once nothing listens at its address, no request of this island
    will ever be answered, and it says so within about a second instead of retrying for its whole timeout."""
    with ThreadService(tmp_path, config()) as service:
        link = service.link(0, timeout_s=120.0)
        assert not link._service_gone()
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        link.port = closed
        link.pairs[0] = None

        def broken(k, deadline):
            raise RuntimeError("connection reset")

        link._connect = broken
        t = time.monotonic()
        with pytest.raises(ServiceGone, match="no longer listens"):
            push(link, 1.0)
        assert time.monotonic() - t < 10.0


@pytest.mark.slow  # a reply 4.5 s late
def test_a_message_may_take_longer_than_the_connect_timeout():
    """A connection is made with a short connect timeout (the island's is 2 s), but a message on a slow link takes
    longer (a 7 MB pull: 11 s at 5 Mbit/s). gloo's point-to-point ops keep the timeout their group was made with
    (set_timeout does not reach them), so each wait carries the connection's own: before, the island's receive
    failed after 2 s and it asked again and again, each answer 7 MB more on the same link."""
    raw = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_dt.timedelta(seconds=30))
    pairs: dict = {}

    def side(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", raw.port, is_master=False, timeout=_dt.timedelta(seconds=30))
        pairs[rank] = Pair.connect(client, "slow", rank, connect_s=3.0, timeout_s=30.0)  # a client each: gloo's
        # connect blocks in its store, and one TCPStore client serves one request at a time

    threads = [threading.Thread(target=side, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    got: dict = {}

    def late_answer() -> None:
        pairs[0].request()
        time.sleep(4.5)  # the answer comes later than the 3 s connect timeout
        pairs[0].answer(ShardReply(True, 7, 0, body=torch.arange(4.0)))

    server = threading.Thread(target=late_answer)
    server.start()
    pairs[1].send(Request(PULL, 1, 0, 0.0, None, 0, 0))
    got["reply"] = pairs[1].reply()
    server.join(30)
    assert got["reply"].version == 7 and torch.equal(got["reply"].body.view(torch.float32), torch.arange(4.0))
    for pair in pairs.values():
        pair.close()


def run_island(service: ThreadService, steps: range, state: dict | None = None) -> Island:
    strategy = ParameterServer(
        inner_steps=2, shards=2, service=ServerProcesses(2, 30.0, 120.0, address=service.address)
    )
    island = Island(World.single(), strategy)
    if state is not None:
        island.model.load_state_dict(state["model"])
        island.opt.load_state_dict(state["opt"])
        strategy.load_state_dict(state["ps"])
    for i in steps:
        island.step(i)
    return island


def test_resume_from_a_checkpoint_through_the_servers_snapshot_continues_exactly(tmp_path):
    torch.set_num_threads(1)

    def fresh(name: str) -> ThreadService:
        torch.manual_seed(0)
        from harness.outer import tiny_model
        from islands.sync.outer.flat import FlatView

        initial = FlatView(tiny_model().parameters()).read()
        from islands.sync.outer.ps import outer_rule

        cfg = ServiceConfig(initial, outer_rule(), islands=1, servers=2, shards=2, lease_s=30.0)
        return ThreadService(tmp_path / name, cfg)

    services = [fresh("whole"), fresh("first"), fresh("second")]
    try:
        whole = run_island(services[0], range(9))
        whole.strategy.finish(whole.model)
        first = run_island(services[1], range(5))  # stops mid-round
        import copy

        saved = copy.deepcopy(
            {"model": first.model.state_dict(), "opt": first.opt.state_dict(), "ps": first.strategy.state_dict()}
        )
        assert len(saved["ps"]["ps_shards"]) == 2 and saved["ps"]["ps_link"]["seq"] == 2
        first.strategy.link.send(Message(LEAVE, 0))  # that job is over: its servers need not wait for it
        first.strategy.link.close()  # and its heartbeat thread ends with it, not beats on into later tests
        second = run_island(services[2], range(5, 9), saved)  # a new job: new servers, restored from the checkpoint
        second.strategy.finish(second.model)
        assert second.strategy.version == whole.strategy.version == 5
        torch.testing.assert_close(second.strategy.global_flat, whole.strategy.global_flat, rtol=0, atol=0)
    finally:
        for s in services:
            s.stop()


def test_bad_server_process_settings_are_refused(capsys):
    argv = ["train", "--workers", "2", "--islands", "2", "--outer"]
    assert islands_cli(*argv, "ps:inner_steps=4,servers=-1") == 2
    assert "servers must be an int >= 0" in capsys.readouterr().err
    assert islands_cli(*argv, "ps:inner_steps=4,servers=2,lease=0") == 2
    assert "lease must be > 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="timeout must be > lease"):
        ServerProcesses(1, lease_s=5.0, timeout_s=2.0)
    with pytest.raises(ValueError, match="VirtualClock"):
        ParameterServer(2, service=ServerProcesses(), arrivals=VirtualClock([1.0]))
    with pytest.raises(ValueError, match="servers must be at most the parameter count 10"):
        config(servers=11)


class EverBusyShard:
    """A shard 'process' that beats and never ends by itself (a server still waiting for an island to settle)."""

    def __init__(self, store: dist.PrefixStore, shard: int):
        self.killed = threading.Event()
        self.thread = threading.Thread(target=self._beat, args=(store, shard), daemon=True)
        self.thread.start()

    def _beat(self, store, shard: int) -> None:
        while not self.killed.wait(0.02):
            store.add(f"sbeat/{shard}", 1)

    def poll(self) -> int | None:
        return -9 if self.killed.is_set() else None

    def kill(self) -> None:
        self.killed.set()

    def wait(self, timeout: float | None = None) -> int:
        self.thread.join(timeout)
        return -9


def test_a_supervisor_whose_islands_are_all_gone_ends_its_servers_though_they_never_settle(tmp_path):
    """No island has beaten for orphan_s: the supervisor sets stop ("orphaned"), and a server that still waits for
    an island to settle is ended 2 leases later, so no service outlives its islands for good (session 38: servers
    and supervisors of the churn bench's byte LM runs were still running an hour after their jobs)."""
    from islands.sync.outer.ps_service import Supervisor

    config(servers=1, islands=1, orphan_s=0.3, lease_s=0.2).save(tmp_path)
    shards: list[EverBusyShard] = []

    def starter(directory, shard, host, port):
        raw = dist.TCPStore(host, port, is_master=False, timeout=_dt.timedelta(seconds=10))
        shards.append(EverBusyShard(dist.PrefixStore("islands-ps", raw), shard))
        return shards[-1]

    supervisor = Supervisor(tmp_path, starter=starter).start()
    assert supervisor.stopped.wait(30.0), "the supervisor kept a server no island needs"
    assert len(shards) == 1 and shards[0].killed.is_set()  # ended, not restarted
    assert supervisor.store.get("stop") == b"orphaned"
