"""A parameter server host of its own (issue #36, `islands ps-host`, ps_host.py): the configuration island 0 sends is
sealed with the job's token and checked before a byte of it is unpickled; the pushes' payload key is derived on both
ends and never sent; a host serves one job through its supervisor and hands the servers' report back; bad input is
refused with what would be right."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch

from harness.cli import islands_cli
from harness.ps import ForkedShard, done_together
from islands.runtime.payload_auth import PayloadAuthError
from islands.sync.outer import ps_host
from islands.sync.outer.ps import OuterRule, ParameterServer, ServerProcesses, parameter_server
from islands.sync.outer.ps_link import Message
from islands.sync.outer.ps_remote import RemoteLink
from islands.sync.outer.ps_report import process_report
from islands.sync.outer.ps_service import ServiceConfig
from islands.sync.outer.ps_wire import PULL, PUSH

SGD1 = OuterRule("sgd", 1.0, 0.0)  # global -= delta: exact sums


def config(**kw) -> ServiceConfig:
    return ServiceConfig(torch.arange(10.0), SGD1, **{"lease_s": 30.0, "max_staleness": 100, **kw})


class Boom:
    """A pickle that runs code when it is loaded: what an unauthenticated configuration could carry."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_sealed_configuration_opens_with_the_token_only_and_carries_no_payload_key():
    secret = b"the job's own payload key, never sent"
    blob = ps_host.seal_config(config(key=secret, domain=b"job"), "token-a")
    assert secret not in blob and b"token-a" not in blob
    opened = ps_host.open_config(blob, "token-a")
    assert torch.equal(opened.initial, torch.arange(10.0)) and opened.servers == 1
    tags = ps_host.payload_tags("token-a", ps_host.verified_nonce(blob, "token-a"))
    assert (opened.key, opened.domain) == (tags.key, tags.domain) and opened.key != secret
    # each job draws a nonce of its own: the same configuration seals, and keys its payloads, differently
    again = ps_host.seal_config(config(), "token-a")
    assert ps_host.open_config(again, "token-a").key != opened.key
    with pytest.raises(PayloadAuthError, match="not sealed with this job's token"):
        ps_host.open_config(blob, "token-b")
    flipped = bytearray(blob)
    flipped[-5] ^= 1
    with pytest.raises(PayloadAuthError, match="does not verify"):
        ps_host.open_config(bytes(flipped), "token-a")
    with pytest.raises(PayloadAuthError, match="not a sealed"):
        ps_host.open_config(b"junk", "token-a")


def test_an_unsealed_pickle_is_refused_before_it_is_loaded(tmp_path):
    planted = tmp_path / "planted"
    body = pickle.dumps(Boom(planted))
    forged = ps_host.MAGIC + bytes(ps_host.NONCE) + bytes(ps_host.MAC) + body
    with pytest.raises(PayloadAuthError):
        ps_host.open_config(forged, "token-a")
    assert not planted.exists()  # nothing of it ran
    pickle.loads(body)  # the same bytes, loaded, would have run
    assert planted.exists()


def served_host(tmp_path, token: str = "tok", **kw):
    host = ps_host.ServerHost(tmp_path / "host", token, say=lambda *_: None, starter=ForkedShard, **kw)
    box: dict = {}

    def run():
        try:
            box["collected"] = host.run()
        except Exception as e:  # noqa: BLE001  # the test reads it
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return host, thread, box


@pytest.mark.slow  # forks a shard server
def test_a_host_serves_one_job_from_its_sealed_configuration_and_hands_back_the_report(tmp_path):
    host, thread, box = served_host(tmp_path)
    address = (host.host, host.port)
    cfg = config(ends_with_starter=True)  # a fixed job's, as ps.py makes it: island 0 alone takes the report
    tags0 = ps_host.configure(address, cfg, "tok", timeout_s=60)
    tags1 = ps_host.job_tags(address, "tok", timeout_s=60)  # another island derives the same key
    assert (tags0.key, tags0.domain) == (tags1.key, tags1.domain)
    links = [
        RemoteLink(address, i, cfg.bounds, 60.0, 30.0, None, tags, None).start() for i, tags in ((0, tags0), (1, tags1))
    ]
    try:
        pulled = links[1].send(Message(PULL, 1))
        assert torch.equal(pulled.flat, torch.arange(10.0))  # the model island 0 sent, served by the host
        links[0].send(Message(PUSH, 0, 0, 4.0, torch.full((10,), 1.0)))
        after = links[1].send(Message(PUSH, 1, 0, 4.0, torch.full((10,), 2.0)))
        assert after.ack.accepted and torch.equal(after.flat, torch.arange(10.0) - 3.0)
        done_together(links)  # DONE is answered once no island is still training
        links[0].store.set("stop", "done")
    finally:
        for link in links:
            link.close()
    collected, why = ps_host.collect_report(address, timeout_s=60)
    thread.join(60)
    assert not thread.is_alive() and "error" not in box and why is None
    report = process_report(collected, why)
    assert report["complete"] and report["servers"][0]["pushes_applied"] == 2
    assert (tmp_path / "host" / "shard0").is_dir()  # the journal is on the host


@pytest.mark.slow  # forks a shard server
def test_a_host_refuses_a_configuration_sealed_with_another_token_and_island_0_says_so(tmp_path):
    host, thread, box = served_host(tmp_path, wait_s=20, report_wait_s=1.0)
    address = (host.host, host.port)
    try:
        with pytest.raises(ValueError, match=r"refused this job's configuration.*not sealed with this job's token"):
            ps_host.configure(address, config(), "wrong", timeout_s=30)
        assert not (tmp_path / "host" / "config.pt").exists()  # nothing of it written
        # still waiting: the right job is served after the refusal
        ps_host.configure(address, config(), "tok", timeout_s=60)
        with pytest.raises(ValueError, match="already holds another job's configuration"):
            ps_host.configure(address, config(), "tok", timeout_s=5)
    finally:
        host.store.set("stop", "test")
        thread.join(60)
    assert not thread.is_alive()


def test_bad_server_host_settings_are_refused(tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match="at must be 'HOST:PORT'"):
        parameter_server(4, servers=1, at="10.0.0.3")
    with pytest.raises(ValueError, match="add servers=S"):
        parameter_server(4, at="10.0.0.3:29600")
    with pytest.raises(ValueError, match="drop address= and directory="):
        ServerProcesses(1, at=("h", 1), address=("h", 2))
    strategy = parameter_server(4, servers=1, at="10.0.0.3:29600")
    assert isinstance(strategy, ParameterServer) and strategy.service.at == ("10.0.0.3", 29600)
    assert strategy.elastic_refusal() is None  # elastic jobs take a server host too (test_ps_elastic.py)
    monkeypatch.delenv(ps_host.TOKEN_ENV, raising=False)
    with pytest.raises(ValueError, match="needs the job's token in ISLANDS_TOKEN"):
        ps_host.job_token(("h", 1))
    with pytest.raises(ValueError, match="needs the job's token"):
        ps_host.ServerHost(tmp_path, "")
    assert islands_cli("ps-host", "--wait", "1") == 2
    assert "the job's token is required" in capsys.readouterr().err
    monkeypatch.setenv(ps_host.TOKEN_ENV, "tok")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert islands_cli("ps-host", "--dir", str(tmp_path / "full"), "--wait", "1") == 2
    assert "is not empty" in capsys.readouterr().err
    assert islands_cli("ps-host", "--port", "70000") == 2
    assert "--port must be" in capsys.readouterr().err
    taken = ps_host.ServerHost(tmp_path / "a", "tok")
    assert islands_cli("ps-host", "--port", str(taken.port), "--wait", "1") == 2
    assert "cannot listen on port" in capsys.readouterr().err
    assert islands_cli("ps-host", "--wait", "0.5") == 1  # nobody came: said, not a traceback
    assert "no job sent its configuration within" in capsys.readouterr().err
