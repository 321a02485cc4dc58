"""Islands that are separate jobs (islands.runtime.cross, issue #35 item 1): the ISLANDS_CROSS_* settings, refused
with the variable named when they cannot work; the World of a joined island; the CLI's --separate-jobs refusals.
The jobs themselves run in tests/integration/frameworks."""

from __future__ import annotations

import pytest
import torch

from harness.cli import islands_cli
from harness.procs import free_port
from islands.runtime.contracts import ElasticCollectives
from islands.runtime.cross import (
    ADDR_ENV,
    AUTH_KEY,
    INDEX_ENV,
    ISLANDS_ENV,
    CrossRefused,
    CrossSettingsError,
    CrossSpec,
    check_token,
    cross_requested,
    mark_gone,
)
from islands.runtime.elastic.auth import MAGIC
from islands.runtime.elastic.membership import TOKEN_ENV, Liveness, authed, connect
from islands.runtime.world import JoinedWorld, close_world, init_world, join_islands


def test_settings_from_the_environment_round_trip():
    spec = CrossSpec("10.0.0.1:29600", islands=3, index=2, host_store=False, timeout_s=30, heartbeat_timeout_s=4)
    env = spec.env()
    assert CrossSpec.from_env(env) == spec
    secret = CrossSpec("10.0.0.1:29600", islands=2, index=0, token="s3cret")
    assert CrossSpec.from_env(secret.env()) == secret and secret.env()[TOKEN_ENV] == "s3cret"
    assert "s3cret" not in repr(secret)
    assert cross_requested(env) and not cross_requested({})
    assert spec.name() == "island2"


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({ADDR_ENV: "h:1"}, f"{ISLANDS_ENV}, {INDEX_ENV}"),
        ({ADDR_ENV: "h:1", ISLANDS_ENV: "2", INDEX_ENV: "2"}, "0..1"),
        ({ADDR_ENV: "h:1", ISLANDS_ENV: "two", INDEX_ENV: "0"}, "must be integers"),
        ({ADDR_ENV: "h:1", ISLANDS_ENV: "2", INDEX_ENV: "0", "ISLANDS_CROSS_HOST_STORE": "yes"}, "must be 1"),
        ({ADDR_ENV: "h:1", ISLANDS_ENV: "2", INDEX_ENV: "0", "ISLANDS_CROSS_TIMEOUT": "-1"}, "positive"),
    ],
)
def test_settings_that_cannot_work_are_refused_naming_the_variable(env, named):
    with pytest.raises(CrossSettingsError, match=named):
        CrossSpec.from_env(env)


def test_an_address_without_a_port_is_refused():
    with pytest.raises(ValueError, match="PORT"):
        CrossSpec("nohost", islands=2, index=0)


def test_who_hosts_the_store_and_never_an_etcd_cluster():
    tcp = "10.0.0.1:29600"
    hosts = [CrossSpec(tcp, islands=2, index=i).hosts_store(s) for i, s in ((0, 0), (0, 1), (1, 0))]
    assert hosts == [True, False, False]  # island 0's worker 0 by default
    assert CrossSpec(tcp, islands=2, index=1, host_store=True).hosts_store(0)
    assert not CrossSpec(tcp, islands=2, index=0, host_store=False).hosts_store(0)
    etcd = "etcd://10.0.0.1:2379/job1"
    assert not CrossSpec(etcd, islands=2, index=0).hosts_store(0)  # island 0 once tried to host one there
    with pytest.raises(CrossSettingsError, match="etcd cluster, which runs on its own"):
        CrossSpec(etcd, islands=2, index=0, host_store=True)


def test_one_island_joined_alone_hosts_the_store_and_trains_with_the_outer_strategy(monkeypatch):
    """K=1 in one process: the island hosts the cross store, forms an epoch of one, and init_world routes to it."""
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    spec = CrossSpec(f"127.0.0.1:{free_port()}", islands=1, index=0, heartbeat_timeout_s=2)
    for key, value in spec.env().items():
        monkeypatch.setenv(key, value)
    world = init_world()
    try:
        assert isinstance(world, JoinedWorld)
        assert (world.rank, world.size, world.islands, world.island, world.local_rank) == (0, 1, 1, 0, 0)
        cross = world.comm("cross")
        assert isinstance(cross, ElasticCollectives) and cross.size == 1
        t = torch.arange(4.0)
        assert torch.equal(cross.all_reduce(t.clone()), t)  # an epoch of one: the identity
        with pytest.raises(ValueError, match="no group over every worker"):
            world.comm("global")
    finally:
        close_world(world)
    close_world(world)  # twice is harmless (the exit handler calls leave again)


def test_join_islands_takes_an_explicit_spec():
    spec = CrossSpec(f"127.0.0.1:{free_port()}", islands=1, index=0, host_store=True, heartbeat_timeout_s=2)
    world = join_islands(spec)
    try:
        assert world.islands == 1 and world.comm("local").size == 1
    finally:
        close_world(world)


def hosted_store():
    """A TCPStore server on a free port and its address (the cross store as island 0 would host it)."""
    port = free_port()
    server = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    return server, f"127.0.0.1:{port}"


def test_a_wrong_token_is_refused_by_name_before_anything_starts():
    """The first island's record holds the islands' token; an island with another token, with none, or with one
    where the islands have none, is refused with an error naming ISLANDS_TOKEN, before any heartbeat or epoch."""
    server, address = hosted_store()
    host, port = address.rsplit(":", 1)
    first = check_token(connect(host, int(port)), "right", address, "0")
    assert first is not None
    again = check_token(connect(host, int(port)), "right", address, "1")  # the same token: the same scope
    assert again is not None and again.scope == first.scope and again.key == first.key
    with pytest.raises(CrossRefused, match=f"wrong token: this island's {TOKEN_ENV} is not the one"):
        check_token(connect(host, int(port)), "wrong", address, "0")
    with pytest.raises(CrossRefused, match=f"use a token, and this island has none: set the same {TOKEN_ENV}"):
        check_token(connect(host, int(port)), "", address, "0")
    # the whole island: join_islands refuses it and wrote nothing of its own (no incarnation, no heartbeat)
    spec = CrossSpec(address, islands=2, index=1, host_store=False, heartbeat_timeout_s=2, token="wrong")
    with pytest.raises(CrossRefused, match="wrong token"):
        join_islands(spec)
    raw = connect(host, int(port))
    assert raw.num_keys() == 1  # the record alone
    open_server, open_address = hosted_store()
    host, port = open_address.rsplit(":", 1)
    assert check_token(connect(host, int(port)), "", open_address, "0") is None
    with pytest.raises(CrossRefused, match=f"run without a token, and this island has {TOKEN_ENV} set"):
        check_token(connect(host, int(port)), "right", open_address, "0")
    del server, open_server


def test_one_island_with_a_token_signs_what_it_writes(monkeypatch):
    """K=1 with ISLANDS_TOKEN: the island trains over the authenticated store (its cross collective works), and what
    it writes there (its heartbeat, its epoch) is signed, not plain."""
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    spec = CrossSpec(f"127.0.0.1:{free_port()}", islands=1, index=0, heartbeat_timeout_s=2, token="s3cret")
    world = join_islands(spec)
    try:
        t = torch.arange(4.0)
        assert torch.equal(world.comm("cross").all_reduce(t.clone()), t)
        host, port = spec.address.rsplit(":", 1)
        raw = connect(host, int(port))
        assert raw.check([AUTH_KEY]) and bytes(raw.get(AUTH_KEY)).startswith(MAGIC)
        for key in ("cross/0/hb/island0", "cross/0/e/0/members"):
            assert bytes(raw.get(key)).startswith(MAGIC), key
    finally:
        close_world(world)


def test_a_launcher_marks_a_failed_island_gone_signed_as_the_islands_sign(monkeypatch):
    """mark_gone: the dead flag of island 1 in every slot's group, which the islands' own signed readers accept
    (and so drop it at once); with another token it is refused by name and nothing is written."""
    server, address = hosted_store()
    host, port = address.rsplit(":", 1)
    spec = CrossSpec(address, islands=2, index=1, token="s3cret")
    reader = check_token(connect(host, int(port)), "s3cret", address, "0")  # island 0 came first
    assert reader is not None
    mark_gone(spec, slots=2)
    signed = authed(connect(host, int(port)), reader)
    for slot in (0, 1):
        assert signed.check([f"cross/{slot}/dead/island1"])
        assert Liveness(torch.distributed.PrefixStore(f"cross/{slot}", signed), 2.0).gone(["island1"]) == {"island1"}
    with pytest.raises(CrossRefused, match="wrong token"):
        mark_gone(CrossSpec(address, islands=2, index=0, token="other"), slots=2)
    assert not signed.check(["cross/0/dead/island0"])
    del server


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--islands", "1"], "K >= 2"),
        (["--islands", "2", "--port", "29500"], "--port"),
        (["--islands", "2", "--elastic"], "two kinds of job"),
        (["--islands", "2", "--timeout", "0"], "positive"),
        (["--islands", "3", "--workers", "4"], "divisible"),
    ],
)
def test_separate_jobs_refuses_what_cannot_work(argv, says, capsys, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('never')\n")
    assert islands_cli("run", "--separate-jobs", *argv, str(script)) == 2
    assert says in capsys.readouterr().err


def test_an_island_dropped_as_slow_is_told_why_and_how_it_comes_back():
    """The line a dropped island exits with (islands.runtime.cross.CrossEpochs; the excepthook init_world installs
    prints it alone): the settings that dropped it, with their values, and the restart that brings it back, not
    the elastic job's `islands join`. The whole path runs in tests/integration/frameworks (the slow island)."""
    from types import SimpleNamespace

    from islands.runtime.cross import CrossEpochs
    from islands.runtime.elastic.epochs import Excluded

    commit = SimpleNamespace(timeout=6.0, liveness=SimpleNamespace(timeout=5.0))
    error = CrossEpochs(None, "island1", commit).excluded(3)
    assert isinstance(error, Excluded) and error.exit_code == 1
    line = str(error)
    assert line.startswith("island1 was dropped by the other islands (cross epoch 3)")
    assert "after ISLANDS_CROSS_TIMEOUT (6 s)" in line and "ISLANDS_CROSS_HEARTBEAT_TIMEOUT (5 s)" in line
    assert "same launch line" in line and "raise ISLANDS_CROSS_TIMEOUT" in line
    assert "islands join" not in line and "\n" not in line
