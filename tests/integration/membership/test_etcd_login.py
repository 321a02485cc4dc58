"""An elastic job's store in an etcd cluster with etcd's own user/password authentication enabled: only a
process with the password (ISLANDS_ETCD_USER, ISLANDS_ETCD_PASSWORD_FILE) reads or writes the job's keys; each
member's token is asked for once and renewed when it lapses; a missing or wrong login is a clear error."""

import base64
import json
import subprocess
import time

import pytest

import harness.elastic as elastic_jobs
from harness.flags import ISLANDS_TRAIN, flags
from islands.runtime.elastic.etcd_store import (
    ENDED_KEY,
    PASSWORD_FILE_ENV,
    USER_ENV,
    EtcdAddress,
    EtcdClient,
    EtcdError,
    EtcdLogin,
    EtcdStore,
)
from islands.testbed import etcd as etcd_cluster

TOKEN_TTL_S = 1  # the members' --auth-token-ttl: short, so a test sees a token lapse


@pytest.fixture(scope="module")
def locked():
    if not etcd_cluster.available():
        pytest.skip("etcd-server is not installed (apt-get install etcd-server; .ci/run does)")
    c = etcd_cluster.EtcdCluster(3, login=True, token_ttl_s=TOKEN_TTL_S).start()
    yield c
    c.stop()


def _endpoints(cluster):
    return EtcdAddress.parse(cluster.url).endpoints


def test_the_login_is_read_from_the_environment_and_bad_settings_are_named(tmp_path):
    assert EtcdLogin.from_env({}) is None
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    login = EtcdLogin.from_env({USER_ENV: "u", PASSWORD_FILE_ENV: str(secret)})
    assert login == EtcdLogin("u", "s3cret") and "s3cret" not in repr(login)
    with pytest.raises(ValueError, match=f"needs both {USER_ENV}.*and {PASSWORD_FILE_ENV}.*got only {USER_ENV}"):
        EtcdLogin.from_env({USER_ENV: "u"})
    with pytest.raises(ValueError, match=f"{PASSWORD_FILE_ENV}=.*nope: cannot read"):
        EtcdLogin.from_env({USER_ENV: "u", PASSWORD_FILE_ENV: str(tmp_path / "nope")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        EtcdLogin.from_env({USER_ENV: "u", PASSWORD_FILE_ENV: str(tmp_path / "empty")})


def test_without_a_login_or_with_a_wrong_password_nothing_is_read_or_written(locked):
    with pytest.raises(EtcdError, match=f"requires a login.*{USER_ENV} and {PASSWORD_FILE_ENV}"):
        EtcdClient(_endpoints(locked), timeout_s=10).put(b"t0/k", b"v")
    with pytest.raises(EtcdError, match=f"refused the login of user 'islands'.*{PASSWORD_FILE_ENV}"):
        EtcdClient(_endpoints(locked), timeout_s=10, login=EtcdLogin("islands", "wrong")).get(b"t0/k")
    assert locked.get(b"t0/k") is None  # and nothing was written


def test_a_client_with_the_login_reads_and_writes_and_renews_a_lapsed_token(locked, monkeypatch):
    for k, v in locked.env().items():
        monkeypatch.setenv(k, v)
    store = EtcdStore(locked.url + "/t1", timeout_s=10)  # the login comes from the environment
    store.set("k", "v")
    assert store.get("k") == b"v" and store.compare_set("k", "v", "w") == b"w"
    assert locked.get(b"t1/k") == b"w"
    logins = store.client.logins
    time.sleep(TOKEN_TTL_S + 2)  # the member forgets the token
    assert store.get("k") == b"w"
    assert store.client.logins == logins + 1  # asked again once, and the read went through


def test_a_member_killed_the_client_logs_in_to_the_next(locked, monkeypatch):
    for k, v in locked.env().items():
        monkeypatch.setenv(k, v)
    store = EtcdStore(locked.url + "/t2", timeout_s=20)
    store.set("k", "1")
    first = store.client._current
    locked.kill(first)
    try:
        store.set("k", "2")  # fails over; the next member does not know the first one's token
        assert store.get("k") == b"2" and store.client._current != first and store.client.logins >= 2
    finally:
        locked.start_member(first)
        deadline = time.monotonic() + 60
        while not locked.healthy(first):
            assert time.monotonic() < deadline, locked.logs()
            time.sleep(0.2)


@pytest.mark.slow  # an elastic job of two islands over the locked store: ~30 s on an idle 2-core machine
def test_an_elastic_job_runs_over_the_locked_store_and_its_keys_are_closed_to_others(locked, tmp_path, monkeypatch):
    for k, v in locked.env().items():
        monkeypatch.setenv(k, v)
    run = tmp_path / "run"
    done = elastic_jobs.train_over_store(locked.url, run, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:] + elastic_jobs.logs(run)
    assert json.loads((run / "run.json").read_text())["summary"]["steps"] == 9
    client = EtcdClient(_endpoints(locked), timeout_s=10, login=EtcdLogin.from_env())
    keys = [base64.b64decode(kv["key"]) for kv in client.range(b"islands-", prefix=True).get("kvs", [])]
    # it used the locked store, and at its end left only its end mark there (EtcdStore.end)
    assert len(keys) == 1 and keys[0].endswith(ENDED_KEY.encode()), keys
    with pytest.raises(EtcdError, match="requires a login"):
        EtcdClient(_endpoints(locked), timeout_s=10).range(b"islands-", prefix=True)


def test_a_bad_login_setting_stops_the_cli_with_one_line(locked, tmp_path):
    env = {**elastic_jobs.env(), USER_ENV: "islands", PASSWORD_FILE_ENV: str(tmp_path / "missing")}
    done = subprocess.run(
        [
            *ISLANDS_TRAIN,
            *flags(task="digits", workers=2, islands=2, outer="diloco:inner_steps=3", elastic=True, store=locked.url),
            *flags(steps=3, no_probe=True, no_progress=True, run_dir=tmp_path / "run"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{PASSWORD_FILE_ENV}=" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "run.json").exists()
