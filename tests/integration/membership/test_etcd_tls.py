"""An elastic job's store in an etcd cluster over TLS that admits clients by certificate (etcds://): only a
holder of a certificate the cluster's CA signed reads or writes the job's keys; a wrong or missing file is a
clear error, not a hang."""

import base64
import json
import os
import shutil

import pytest

import harness.elastic as elastic_jobs
from islands.runtime.elastic.etcd_store import (
    CA_ENV,
    CERT_ENV,
    ENDED_KEY,
    KEY_ENV,
    EtcdAddress,
    EtcdClient,
    EtcdError,
    EtcdStore,
    EtcdTLS,
)
from islands.testbed import etcd as etcd_cluster


@pytest.fixture(scope="module")
def secure():
    if not etcd_cluster.available() or shutil.which("openssl") is None:
        pytest.skip("etcd-server or openssl is not installed (apt-get install etcd-server openssl; .ci/run does)")
    c = etcd_cluster.EtcdCluster(3, tls=True).start()
    yield c
    c.stop()


def _without(monkeypatch, *names):
    for name in (CA_ENV, CERT_ENV, KEY_ENV):
        monkeypatch.delenv(name, raising=False)
    return names


def test_a_client_with_the_clusters_certificate_reads_and_writes(secure, monkeypatch):
    for k, v in secure.env().items():
        monkeypatch.setenv(k, v)
    assert secure.url.startswith("etcds://") and EtcdAddress.parse(secure.url).tls
    store = EtcdStore(secure.url + "/t1", timeout_s=10)
    store.set("k", "v")
    assert store.get("k") == b"v" and store.compare_set("k", "v", "w") == b"w"
    assert secure.get(b"t1/k") == b"w"  # the cluster's own reads go over TLS with its client certificate


def test_without_the_ca_or_the_client_certificate_the_member_refuses_with_a_clear_message(secure, monkeypatch):
    _without(monkeypatch)
    with pytest.raises(EtcdError, match=f"does not verify.*{CA_ENV}"):
        EtcdStore(secure.url + "/t2", timeout_s=10).set("k", "v")
    monkeypatch.setenv(CA_ENV, secure.env()[CA_ENV])
    with pytest.raises(EtcdError, match=f"refused this client's certificate.*{CERT_ENV} and {KEY_ENV}"):
        EtcdStore(secure.url + "/t2", timeout_s=10).set("k", "v")


def test_a_certificate_from_another_ca_is_refused(secure, tmp_path, monkeypatch):
    other = etcd_cluster.EtcdCluster(1, root=tmp_path, tls=True)  # its own CA; never started
    try:
        monkeypatch.setenv(CA_ENV, secure.env()[CA_ENV])
        monkeypatch.setenv(CERT_ENV, other.env()[CERT_ENV])
        monkeypatch.setenv(KEY_ENV, other.env()[KEY_ENV])
        with pytest.raises(EtcdError, match="refused this client's certificate"):
            EtcdStore(secure.url + "/t3", timeout_s=10).get("k")
    finally:
        other.stop()


def test_bad_tls_settings_are_named(tmp_path):
    with pytest.raises(ValueError, match=f"not found: {CA_ENV}="):
        EtcdTLS.from_env({CA_ENV: str(tmp_path / "nope.crt")})
    cert = tmp_path / "c.crt"
    cert.write_text("x")
    with pytest.raises(ValueError, match=f"needs both {CERT_ENV} and {KEY_ENV}; got only {CERT_ENV}"):
        EtcdTLS.from_env({CERT_ENV: str(cert)})


@pytest.mark.slow  # an elastic job of two islands over the TLS store: ~30 s on an idle 2-core machine
def test_an_elastic_job_runs_over_the_tls_store_and_its_keys_are_closed_to_others(secure, tmp_path, monkeypatch):
    for k, v in secure.env().items():
        monkeypatch.setenv(k, v)
    run = tmp_path / "run"
    done = elastic_jobs.train_over_store(secure.url, run, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:] + elastic_jobs.logs(run)
    rec = json.loads((run / "run.json").read_text())
    assert rec["summary"]["steps"] == 9
    client = EtcdClient(EtcdAddress.parse(secure.url).endpoints, timeout_s=10, tls=EtcdTLS.from_env())
    keys = [base64.b64decode(kv["key"]) for kv in client.range(b"islands-", prefix=True).get("kvs", [])]
    # it used the TLS store, and at its end left only its end mark there (EtcdStore.end)
    assert len(keys) == 1 and keys[0].endswith(ENDED_KEY.encode()), keys
    bare = EtcdClient(
        EtcdAddress.parse(secure.url).endpoints, timeout_s=10, tls=EtcdTLS(ca=os.environ[CA_ENV])
    )  # verifies the members, has no certificate of its own
    with pytest.raises(EtcdError, match="refused this client's certificate"):
        bare.range(b"islands-", prefix=True)
