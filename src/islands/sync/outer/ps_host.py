"""Parameter servers on a host of their own (issue #36): a machine that runs no island lends its CPU and network to
the servers, as BytePS's spare machines do (LIT-051). `islands ps-host` starts there and waits; a job's island 0
sends it the servers' configuration; the supervisor and its shard servers (ps_service.py) then run on that host
until the job ends, and the servers' report goes back to the islands through the store (Keys, below).

    host machine:   ISLANDS_TOKEN=... islands ps-host --dir /var/tmp/ps --port 29600
    the job:        ISLANDS_TOKEN=... islands train ... --outer "ps:inner_steps=50,servers=2,at='10.0.0.3:29600'"

Trust. The configuration is a pickle (the outer rule, codec and aggregator are objects), so the host accepts only
one sealed with the job's token: island 0 draws a nonce and sends MAGIC | nonce | HMAC | body, the HMAC under a key
derived from the token and the nonce, and the host checks it before it unpickles a byte. The payload key of the
pushes and pulls is not sent at all: the host and every island derive it from the token and the same nonce (a fresh
one per job, so a push recorded in an earlier job does not verify in this one). Whoever can reach the port but lacks
the token can neither configure the servers nor forge a push; they can post a configuration that the host refuses
(it says why under REFUSED_KEY and keeps waiting), or replay an earlier job's sealed one first, which the host
accepts and island 0 then detects (the store holds a configuration that is not its own): a denial of service, not a
corrupted model.

Keys in the service's store (prefix islands-ps, beside ps_service's): CONFIG_KEY the sealed configuration,
REFUSED_KEY why the host refused one; in a fixed job REPORT_KEY the servers' collected report (ps_report.collect)
once they are gone and TAKEN_KEY island 0, the one that writes run.json, has read it (the host then exits; without
it, after `report_wait_s`). An elastic job's islands take the report as from an elastic job's own supervisor
(ps_report.hand_over's keys): every island takes it (the one that writes run.json is settled only at the job's end,
and may take it last), so the host stays until every island its servers answered final has taken it, no island has
beaten for 2 x the lease (a dead one is not waited for), or `report_wait_s` ran out; it says which as it leaves.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import io
import json
import os
import secrets
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from islands.runtime.elastic.auth import derive_key
from islands.runtime.payload_auth import PayloadAuthError, PayloadTags
from islands.sync.outer.ps_elastic import ElasticService
from islands.sync.outer.ps_report import hand_over, read_collected
from islands.sync.outer.ps_service import ServiceConfig, Starter, Supervisor, start_shard
from islands.sync.outer.ps_wire import new_client

MAGIC = b"islands-ps-host-v1|"
NONCE = 16
MAC = 32
CONFIG_KEY = "host/config"
REFUSED_KEY = "host/refused"
REPORT_KEY = "host/report"
TAKEN_KEY = "host/report-taken"


TOKEN_ENV = "ISLANDS_TOKEN"  # the job's secret (islands.runtime.elastic.membership's name for it)


def parse_at(text: str) -> tuple[str, int]:
    """'HOST:PORT' of a server host -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"at must be 'HOST:PORT' of an `islands ps-host` (quoted in a spec: at='10.0.0.3:29600'), got {text!r}"
        )
    return host, int(port)


def job_token(at: tuple[str, int], env=None) -> str:
    """The job's token, which the server host at `at` checks the configuration with; ValueError without one."""
    token = (os.environ if env is None else env).get(TOKEN_ENV, "")
    if not token:
        raise ValueError(
            f"ps at={at[0]}:{at[1]} (a server host) needs the job's token in {TOKEN_ENV}, the same one the "
            "`islands ps-host` there was started with: the host accepts only a configuration sealed with it"
        )
    return token


def _seal_key(token: str, nonce: bytes) -> bytes:
    return derive_key(token, "ps-host-config|" + nonce.hex())


def payload_tags(token: str, nonce: bytes) -> PayloadTags:
    """The pushes' and pulls' tags of the job whose configuration carried `nonce`: derived on both ends, never sent."""
    return PayloadTags(derive_key(token, "ps-host-payload|" + nonce.hex()), b"ps-host|" + nonce)


def seal_config(config: ServiceConfig, token: str) -> bytes:
    """The configuration as island 0 sends it: without any payload key, sealed with the token (module docstring)."""
    nonce = secrets.token_bytes(NONCE)
    buf = io.BytesIO()
    torch.save(replace(config, key=None, domain=b""), buf)
    body = buf.getvalue()
    mac = hmac.new(_seal_key(token, nonce), MAGIC + nonce + body, hashlib.sha256).digest()
    return MAGIC + nonce + mac + body


def verified_nonce(blob: bytes, token: str) -> bytes:
    """The nonce of a sealed configuration whose HMAC verifies under `token`; PayloadAuthError otherwise."""
    head = len(MAGIC) + NONCE + MAC
    if not blob.startswith(MAGIC) or len(blob) <= head:
        raise PayloadAuthError("not a sealed parameter server configuration (islands-ps-host-v1)")
    nonce, mac, body = blob[len(MAGIC) : len(MAGIC) + NONCE], blob[len(MAGIC) + NONCE : head], blob[head:]
    want = hmac.new(_seal_key(token, nonce), MAGIC + nonce + body, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, want):
        raise PayloadAuthError("the configuration's seal does not verify: it was not sealed with this job's token")
    return nonce


def open_config(blob: bytes, token: str) -> ServiceConfig:
    """A sealed configuration, checked before a byte of it is unpickled, with this job's derived payload key."""
    nonce = verified_nonce(blob, token)
    # weights_only=False: the rule, codec and aggregator are objects; the seal above says island 0 sent them
    config = torch.load(io.BytesIO(blob[len(MAGIC) + NONCE + MAC :]), weights_only=False)
    if not isinstance(config, ServiceConfig):
        raise PayloadAuthError("the sealed configuration holds no ServiceConfig")
    tags = payload_tags(token, nonce)
    config.key, config.domain = tags.key, tags.domain
    return config


def configure(address: tuple[str, int], config: ServiceConfig, token: str, timeout_s: float) -> PayloadTags:
    """Island 0: send the sealed configuration to the host at `address` (first one wins) and return the payload
    tags; ValueError when the host already holds another job's configuration."""
    where = f"{address[0]}:{address[1]}"
    store = new_client(address[0], address[1], timeout_s)
    blob = seal_config(config, token)
    # set only if absent; returns what the key holds now (torch's stub says str; the binding takes bytes)
    held = store.compare_set(CONFIG_KEY, "", blob)  # type: ignore[arg-type]
    if held != blob:
        raise ValueError(
            f"the parameter server host at {where} already holds another job's configuration; start a fresh "
            "`islands ps-host` for this job"
        )
    deadline = time.monotonic() + timeout_s
    while int(store.add("gen/0", 0)) == 0:  # until its first server serves, or it refuses ours (removes it)
        if not store.check([CONFIG_KEY]):
            why = store.get(REFUSED_KEY).decode() if store.check([REFUSED_KEY]) else "no reason given"
            raise ValueError(f"the parameter server host at {where} refused this job's configuration: {why}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the parameter server host at {where} started no server within {timeout_s:.0f} s")
        time.sleep(0.05)
    return payload_tags(token, verified_nonce(blob, token))


def job_tags(address: tuple[str, int], token: str, timeout_s: float) -> PayloadTags:
    """Any island: wait for island 0's sealed configuration at the host and derive the payload tags from it."""
    store = new_client(address[0], address[1], timeout_s)
    deadline = time.monotonic() + timeout_s
    while not store.check([CONFIG_KEY]):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"island 0 sent no configuration to the parameter server host at {address[0]}:{address[1]} "
                f"within {timeout_s:.0f} s"
            )
        time.sleep(0.05)
    return payload_tags(token, verified_nonce(store.get(CONFIG_KEY), token))


def island_tags(at: tuple[str, int], config: ServiceConfig, island: int, timeout_s: float) -> PayloadTags:
    """An island of a job whose servers run on the host at `at`: island 0 sends it the sealed configuration; every
    island derives the pushes' payload tags from the job's token and that configuration's nonce."""
    token = job_token(at)
    return configure(at, config, token, timeout_s) if island == 0 else job_tags(at, token, timeout_s)


def elastic_island_tags(
    at: tuple[str, int], config: ServiceConfig, elastic: ElasticService, configures: bool, timeout_s: float
) -> PayloadTags:
    """An island of an elastic job whose servers run on the host at `at`. The one that `configures` (the first
    epoch's rank 0) sends the host the sealed configuration, then writes the host's address in the job's store as it
    would its own service's; every other island, restarted or joining ones too, waits for that address and derives
    the payload tags from the configuration the host holds (configuring it again would be refused: the host keeps
    the first)."""
    token = job_token(at)
    if configures:
        tags = configure(at, config, token, timeout_s)
        elastic.publish(at)
        return tags
    elastic.address()  # the host is configured (or the job is over: JobEnded)
    return job_tags(at, token, timeout_s)


def collect_report(address: tuple[str, int], timeout_s: float) -> tuple[dict | None, str | None]:
    """Island 0 of a fixed job, after asking the job to stop: the host's collected report once its servers are gone
    ((None, why) when none came within `timeout_s`); tells the host it may leave. An elastic job's islands take it
    with ps_report.take_report instead (module docstring)."""
    try:
        store = new_client(address[0], address[1], timeout_s)
        deadline = time.monotonic() + timeout_s
        while not store.check([REPORT_KEY]):
            if time.monotonic() > deadline:
                return None, f"the server host sent no report within {timeout_s:.0f} s"
            time.sleep(0.05)
        collected = json.loads(store.get(REPORT_KEY))
        store.set(TAKEN_KEY, "1")
    except (RuntimeError, OSError) as e:  # the host is gone (DistNetworkError is a RuntimeError)
        return None, f"the server host could not be asked for its report: {e}"
    return collected.get("collected"), collected.get("missing")


class AddressInUse(ValueError):
    """The server host could not listen on the port it was given."""


class ServerHost:
    """`islands ps-host`: hosts the service's store on `port` (every interface), waits up to `wait_s` for a job's
    sealed configuration, runs the supervisor and its servers in `directory` until the job ends, then publishes
    the servers' report and waits up to `report_wait_s` for island 0 to take it (in an elastic job: every island
    answered final, module docstring). `advertise`: the address the
    islands reach this host by (the supervisor tells it to its servers). `say`: where progress lines go.
    `starter`: how a shard server's process starts (ps_service.Supervisor's)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        token: str,
        port: int = 0,
        advertise: str = "127.0.0.1",
        wait_s: float = 600.0,
        report_wait_s: float = 60.0,
        say=print,
        starter: Starter = start_shard,
    ):
        if not token:
            raise ValueError(
                "a parameter server host needs the job's token (ISLANDS_TOKEN, the islands' own): it accepts only a "
                "configuration sealed with it"
            )
        self.dir, self.token, self.say, self.starter = Path(directory), token, say, starter
        self.wait_s, self.report_wait_s = wait_s, report_wait_s
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            self.raw = dist.TCPStore(
                advertise, port, is_master=True, wait_for_workers=False, timeout=_dt.timedelta(seconds=30)
            )
        except RuntimeError as e:  # DistNetworkError: the port is taken, or not ours to bind
            raise AddressInUse(f"cannot listen on port {port}: {e}".splitlines()[0]) from None
        self.host, self.port = advertise, int(self.raw.port)
        self.store = dist.PrefixStore("islands-ps", self.raw)

    def await_config(self) -> ServiceConfig:
        """The first configuration that verifies; one that does not is refused (said in the store) and removed."""
        deadline = time.monotonic() + self.wait_s
        while True:
            if self.store.check([CONFIG_KEY]):
                blob = self.store.get(CONFIG_KEY)
                try:
                    return open_config(blob, self.token)
                except PayloadAuthError as e:
                    self.store.set(REFUSED_KEY, str(e))
                    self.store.delete_key(CONFIG_KEY)
                    self.say(f"islands ps-host: refused a configuration: {e}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no job sent its configuration within {self.wait_s:.0f} s")
            time.sleep(0.05)

    def run(self) -> dict:
        """Serve one job; returns what the servers reported (ps_report.collect's form, None if they wrote none)."""
        config = self.await_config()
        config.save(self.dir)
        self.say(
            f"islands ps-host: serving a job of {config.islands} island(s): {config.servers} server(s), "
            f"{config.initial.numel()} parameters"
        )
        Supervisor(self.dir, self.host, self.port, self.starter, raw=self.raw).run()
        collected = read_collected(self.dir)
        if config.ends_with_starter:  # a fixed job: island 0 alone takes the report and writes run.json
            left = self.hand_to_island_0(collected)
        else:  # an elastic job: every island takes it, and the one that writes run.json may come last
            left = hand_over(self.store, collected, 2 * config.lease_s, self.report_wait_s)
        stop = self.store.get("stop").decode() if self.store.check(["stop"]) else "?"
        self.say(f"islands ps-host: the job ended ({stop}); leaving: {left}")
        return collected or {}

    def hand_to_island_0(self, collected: dict | None) -> str:
        """Publish the report for a fixed job's island 0 (collect_report) and wait up to `report_wait_s` for its
        take; returns why the wait ended."""
        missing = None if collected is not None else "the supervisor wrote no report"
        self.store.set(REPORT_KEY, json.dumps({"collected": collected, "missing": missing}))
        deadline = time.monotonic() + self.report_wait_s
        while not self.store.check([TAKEN_KEY]):
            if time.monotonic() > deadline:
                return f"island 0 did not take the report within {self.report_wait_s:.0f} s"
            time.sleep(0.05)
        return "island 0 took the report"


def main(directory: str, token: str, port: int, advertise: str, wait_s: float) -> int:
    """The body of `islands ps-host` (cli_ps.py): 0 when the job ended, 1 when none came."""
    host = ServerHost(directory, token, port, advertise, wait_s)
    print(f"islands ps-host: listening on {host.host}:{host.port}; waiting for a job", flush=True)
    try:
        host.run()
    except TimeoutError as e:
        print(f"islands ps-host: {e}", file=sys.stderr, flush=True)
        return 1
    return 0
