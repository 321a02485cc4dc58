"""What a parameter server island keeps in an elastic job's store (islands.sync.outer.ps_elastic): the service's
address, a number of its own per island process, the step a restart of its data shard starts at, and the job's
end that a late joiner finds (docs/parameter-server.md, "Elastic jobs"). The store is a dict."""

from __future__ import annotations

import pytest

from harness.dict_store import DictStore
from islands.runtime.elastic import JobEnded
from islands.sync.outer.ps_elastic import ElasticService


class Counting(DictStore):
    def add(self, key: str, amount: int) -> int:
        value = int(self.kv.get(key, b"0")) + amount
        self.set(key, str(value))
        return value


def test_the_address_travels_through_the_store_and_each_island_process_takes_its_own_number():
    store = Counting()
    starter, other = ElasticService(store, "w0", 0, 1.0), ElasticService(store, "w1", 1, 1.0)
    with pytest.raises(TimeoutError, match="no parameter server address"):
        ElasticService(store, "w1", 1, 0.1).address()  # nobody wrote one
    starter.publish(("127.0.0.1", 4321))
    assert other.address() == ("127.0.0.1", 4321)
    assert [starter.take_island(), other.take_island(), other.take_island()] == [0, 1, 2]
    other.pulled(2)
    assert store.get("ps/island/w1") == b"2"


def test_a_restart_starts_at_its_shards_last_acknowledged_step_and_a_late_joiner_finds_the_job_over():
    store = Counting()
    first, restarted = ElasticService(store, "w1", 1, 1.0), ElasticService(store, "w1.1", 1, 1.0)
    assert restarted.start_step() == 0  # nothing pushed yet on shard 1
    first.record(8, 1, 2)
    first.record(12, 1, 3)
    ElasticService(store, "w0", 0, 1.0).record(40, 0, 10)  # another shard's step is not ours
    assert restarted.start_step() == 12
    first.publish(("127.0.0.1", 4321))
    first.finished()
    with pytest.raises(JobEnded, match="final answer before this one joined"):
        restarted.address()


def test_rejoin_ahead_starts_at_the_furthest_step_any_shard_acknowledged():
    store = Counting()
    own = ElasticService(store, "w1.1", 1, 1.0, shards=3)
    assert own.start_step(ahead=True) == 0  # nothing acknowledged anywhere yet
    ElasticService(store, "w1", 1, 1.0, shards=3).record(12, 1, 3)
    assert own.start_step(ahead=True) == 12  # only its own shard has pushed
    ElasticService(store, "w0", 0, 1.0, shards=3).record(40, 0, 10)
    ElasticService(store, "w2", 2, 1.0, shards=3).record(36, 2, 9)
    assert own.start_step() == 12 and own.start_step(ahead=True) == 40


def test_rejoin_in_the_spec():
    from islands.sync.outer import make_outer

    assert make_outer("ps:inner_steps=4,servers=1,rejoin=ahead").service.rejoin == "ahead"
    assert make_outer("ps:inner_steps=4,servers=1").service.rejoin == "own"
    with pytest.raises(ValueError, match="rejoin must be one of own, ahead"):
        make_outer("ps:inner_steps=4,servers=1,rejoin=last")
    with pytest.raises(ValueError, match="needs servers=S >= 1"):
        make_outer("ps:inner_steps=4,rejoin=ahead")
