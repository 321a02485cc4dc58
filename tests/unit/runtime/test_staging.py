"""Host staging of device tensors (islands.runtime.staging) and the choice of the cross-island backend
(islands.runtime.world.resolve_cross_backend), without processes: the wrapped Comm is a recording fake, and
`needs_staging` is switched on so CPU tensors take the path a CUDA tensor takes."""

from __future__ import annotations

import pytest
import torch

import islands.runtime.staging as staging
from islands.runtime.comm import CommLedger
from islands.runtime.staging import HostBuffers, StagedComm, StagedElasticComm
from islands.runtime.world import resolve_cross_backend, stages_across


class FakeComm:
    """Two ranks' worth of answers from one: all_reduce doubles, all_gather returns the tensor and its
    negation, broadcast adds 1; records every tensor it was handed."""

    elastic = False
    epoch = None
    size = 2
    rank = 0
    group = None

    def __init__(self):
        self.ledger = CommLedger()
        self.seen: list[torch.Tensor] = []
        self.fail = False

    def _see(self, t):
        self.seen.append(t)
        if self.fail:
            raise RuntimeError("peer gone")

    def all_reduce(self, t, op=None, kind="all_reduce"):
        self._see(t)
        return t.mul_(2)

    def all_reduce_async(self, t, op=None, kind="all_reduce"):
        self._see(t)
        self.pending: torch.futures.Future = torch.futures.Future()
        self.pending_tensor = t
        return self.pending

    def all_gather(self, t, kind="all_gather"):
        self._see(t)
        return [t.clone(), -t]

    def broadcast(self, t, src, kind="broadcast"):
        self._see(t)
        return t.add_(1)

    def reduce_scatter(self, t, op=None, kind="reduce_scatter"):
        self._see(t)
        return t.chunk(2)[0] * 2

    def all_gather_object(self, obj):
        return [obj, obj]


@pytest.fixture
def staged_everything(monkeypatch):
    monkeypatch.setattr(staging, "needs_staging", lambda t: True)


def test_host_tensors_pass_straight_through():
    fake = FakeComm()
    comm = StagedComm(fake)
    t = torch.ones(3)
    comm.all_reduce(t)
    assert fake.seen[0] is t and t.tolist() == [2, 2, 2]
    assert comm.buffers.allocated == 0


def test_staged_all_reduce_runs_on_a_host_copy_and_lands_in_place(staged_everything):
    fake = FakeComm()
    comm = StagedComm(fake)
    t = torch.arange(6.0).reshape(2, 3)
    out = comm.all_reduce(t)
    assert out is t
    assert fake.seen[0] is not t and fake.seen[0].data_ptr() != t.data_ptr()  # the transport saw a host buffer
    assert t.tolist() == [[0, 2, 4], [6, 8, 10]]
    for _ in range(5):  # the same buffer, every round
        comm.all_reduce(t)
    assert comm.buffers.allocated == 1


def test_staged_gathers_come_back_shaped_and_separate(staged_everything):
    comm = StagedComm(FakeComm())
    t = torch.arange(4.0).reshape(2, 2)
    parts = comm.all_gather(t)
    assert [p.shape for p in parts] == [t.shape, t.shape]
    assert parts[1].tolist() == (-t).tolist()
    cat = comm.all_gather_cat(t)
    assert cat.shape == (4, 2)
    # the buffer went back to the pool: the parts are copies, not views of it
    comm.all_reduce(torch.zeros(2, 2))
    assert parts[0].tolist() == t.tolist()


def test_broadcast_and_reduce_scatter_staged(staged_everything):
    comm = StagedComm(FakeComm())
    t = torch.zeros(2, 2)
    comm.broadcast(t, src=0)
    assert t.tolist() == [[1, 1], [1, 1]]
    out = comm.reduce_scatter(torch.arange(4.0).reshape(4, 1))
    assert out.tolist() == [[0.0], [2.0]]


def test_an_async_exchange_holds_its_buffer_until_it_lands(staged_everything):
    fake = FakeComm()
    comm = StagedComm(fake)
    a = torch.ones(4)
    fut = comm.all_reduce_async(a)
    first = fake.pending
    first_host = fake.pending_tensor
    comm.all_reduce_async(torch.ones(4))  # in flight at once: must not share the first one's buffer
    assert fake.pending_tensor.data_ptr() != first_host.data_ptr()
    assert comm.buffers.allocated == 2
    assert a.tolist() == [1, 1, 1, 1]  # nothing lands before the exchange does
    first_host.mul_(3)
    first.set_result(first_host)
    assert fut.wait() is a and a.tolist() == [3, 3, 3, 3]
    comm.all_reduce(torch.ones(4))  # the landed one's buffer is free again
    assert comm.buffers.allocated == 2


def test_a_failed_exchange_gives_its_buffer_back_and_raises(staged_everything):
    fake = FakeComm()
    comm = StagedComm(fake)
    fake.fail = True
    with pytest.raises(RuntimeError, match="peer gone"):
        comm.all_reduce(torch.ones(3))
    fake.fail = False
    comm.all_reduce(torch.ones(3))
    assert comm.buffers.allocated == 1


def test_host_buffers_by_dtype_and_size():
    pool = HostBuffers()
    a = pool.take(torch.zeros(3))
    b = pool.take(torch.zeros(3, dtype=torch.float64))
    assert a.dtype == torch.float32 and b.dtype == torch.float64 and pool.allocated == 2
    pool.give(a)
    assert pool.take(torch.zeros(1, 3)) is a  # same dtype and element count: reused whatever the shape
    assert pool.take(torch.zeros(3)) is not a  # a is out again: a second holder gets its own
    assert not a.is_pinned()  # page-locked only for a device's copies (needs CUDA)


@pytest.mark.parametrize(
    "requested, backend, gloo_links, want",
    [
        ("auto", "gloo", False, "gloo"),
        ("auto", "gloo", True, "gloo"),
        ("auto", "nccl", False, "nccl"),  # one site's fabric: NCCL throughout
        ("auto", "nccl", True, "gloo"),  # shaped or failing links: gloo, which fails instead of hanging
        ("gloo", "nccl", False, "gloo"),
        ("nccl", "nccl", True, "nccl"),
    ],
)
def test_resolve_cross_backend(requested, backend, gloo_links, want):
    assert resolve_cross_backend(requested, backend, gloo_links) == want


def test_cross_backend_refusals_name_the_way_out():
    with pytest.raises(ValueError, match=r"needs a CUDA world.*cross_backend=gloo or auto"):
        resolve_cross_backend("nccl", "gloo")
    with pytest.raises(ValueError, match=r"auto, gloo, nccl.*'mpi'"):
        resolve_cross_backend("mpi", "gloo")


def test_only_a_device_world_crossing_on_gloo_stages():
    assert stages_across(torch.device("cuda", 0), "gloo")
    assert not stages_across(torch.device("cuda", 0), "nccl")
    assert not stages_across(torch.device("cpu"), "gloo")


class FakeElasticComm(FakeComm):
    """An elastic Comm whose planned round fails once and is planned again over the survivors."""

    elastic = True
    names = ("w0", "w1")

    def exchange_planned(self, plan, like, kind="p2p"):
        self.plans = [plan(0, 3), plan(0, 2)]  # the first attempt failed: a second plan over fewer members
        sends, recv_from = self.plans[-1]
        for t in sends.values():
            self._see(t)
        return {p: torch.full(like.shape, float(p), dtype=like.dtype) for p in recv_from}, sorted(sends), recv_from


def test_a_staged_elastic_comm_plans_each_attempt_on_host_copies(staged_everything):
    fake = FakeElasticComm()
    comm = StagedElasticComm(fake, HostBuffers())
    assert comm.names == ("w0", "w1") and comm.elastic
    x = torch.arange(3.0)
    calls = []

    def plan(rank, size):
        calls.append(size)
        return {1: x * size}, [1]

    got, send_to, recv_from = comm.exchange_planned(plan, like=torch.zeros(3), kind="gossip")
    assert calls == [3, 2]  # every attempt planned anew, through the staging
    assert fake.seen[-1].tolist() == (x * 2).tolist() and fake.seen[-1] is not x
    assert (send_to, recv_from) == ([1], [1])
    assert got[1].tolist() == [1.0, 1.0, 1.0]


def test_an_elastic_worker_trains_on_the_cpu_unless_cuda_is_asked(monkeypatch):
    from islands.runtime.elastic.island_comm import IslandPlace
    from islands.runtime.world import elastic_device

    assert elastic_device("auto") == torch.device("cpu")
    assert elastic_device("cpu", IslandPlace.from_env("0,1,2,0")) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        elastic_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="island of 2 workers trains on the CPU"):
        elastic_device("cuda", IslandPlace.from_env("0,1,2,0"))
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        elastic_device("gpu")
