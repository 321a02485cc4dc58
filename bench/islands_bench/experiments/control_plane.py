"""control-plane: a process without the job token attacks a running elastic job through its store.

Issue #20 item 6. A real elastic DiLoCo job on digits (launcher, coordinator, N worker processes, gloo on
loopback) runs while an attacker process, started without ISLANDS_TOKEN, reaches the job's TCPStore as any
process on the network could and tries: joins with guessed tokens; forged admissions (a pending joiner, an
epoch listing it, its heartbeat); forged exclusions and stops (dead flags for members, "fail" verdicts for
the operations ahead, a far "latest" epoch); replays of genuine values captured from the store (moved to
other keys or written back over newer ones); tampered genuine values (one bit flipped, written back); and
injected state (a job record naming a script to run, a process group's rendezvous addresses). Every reader
of the job (the workers and the launcher) runs with ISLANDS_AUTH_AUDIT and records when it accepted each
(key, value); a write of the attacker counts as accepted if any reader accepted exactly that value under
that key at or after the moment it was written. Goal: 0 accepted of every kind, the job finishing as the
same job without the attacker does (same members, no fail-over it did not need, survivors agreeing).

Side by side in the same invocation: the job without the attacker (baseline), the cost of the control
plane's MACs per store operation (AuthStore vs the raw store), and HMAC-SHA256 throughput over tensor
payloads against a gloo all-reduce of the same bytes (the optional payload check's cost).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from islands_bench.harness import SMOKE_LM, BenchContext, experiment

STORE_PREFIX = "islands"  # the elastic job's keys (docs/membership.md); the attacker needs nothing else

# The attacker: a plain store client, no token. It knows the protocol's key layout and envelope format (both
# are documented) and forges envelopes under a key of its own.
ATTACKER = r'''
import datetime, hashlib, hmac, json, os, pathlib, random, secrets, sys, time
import torch.distributed as dist

address_file = pathlib.Path(sys.argv[1])  # started before the job, it learns the job's address from this file
pathlib.Path(sys.argv[1] + ".imported").write_text("")
while not address_file.exists():
    time.sleep(0.02)
host, port = address_file.read_text().rsplit(":", 1)
out_path, duration, workers = sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
assert not os.environ.get("ISLANDS_TOKEN"), "the attacker must not have the token"
store = dist.PrefixStore(sys.argv[5], dist.TCPStore(host, int(port), is_master=False,
                                                    timeout=datetime.timedelta(seconds=10)))
rng = random.Random(7)
journal = open(out_path, "w", buffering=1)  # one JSON line per attempt: the bench stops this process any time
mine = set()  # every value this process wrote: replays and tampering use genuine values only
MY_KEY = secrets.token_bytes(32)  # a guess at the job's key: what a forger without the token has


def digest(key, raw):
    return hashlib.sha256(key.encode() + b"\0" + raw).hexdigest()[:24]


def envelope(key, value, sender="launcher"):
    n = time.time_ns() + 10**12  # "newer" than anything genuine, to win a replay check if MACs were not checked
    head = json.dumps([key, sender, n]).encode()
    mac = hmac.new(MY_KEY, head + b"\0" + value, hashlib.sha256).hexdigest()
    return b"isl1 " + json.dumps({"s": sender, "n": n, "m": mac}).encode() + b"\n" + value


def write(kind, key, raw):
    try:
        store.set(key, raw)
    except Exception as e:  # the job ended
        return False
    mine.add(raw)
    journal.write(json.dumps({"kind": kind, "key": key, "digest": digest(key, raw), "t": time.time()}) + "\n")
    return True


def both(kind, key, value, sender="launcher"):
    """A forgery two ways: the bare value (unsigned) and an envelope under the attacker's own key."""
    write(kind, key, value)
    write(kind, key, envelope(key, value, sender))


def raw(key):
    r = store.get(key) if store.check([key]) else None
    return None if r in mine else r  # genuine values only


def value_of(r):
    return r.partition(b"\n")[2] if r is not None else None


def flip(r):
    b = bytearray(r)
    i = rng.randrange(len(b) - max(1, len(value_of(r) or b"")), len(b)) if value_of(r) else rng.randrange(len(b))
    b[i] ^= 1 << rng.randrange(8)
    return bytes(b)


while not store.check(["e/0/members"]):
    time.sleep(0.02)

# 1. joins with guessed tokens: the coordinator's verdict says whether it admitted us
for i in range(5):
    t = store.add("join/tickets", 1)
    name = f"mallory{i}"
    store.set(f"join/{t}/name", name)
    deadline = time.time() + 20
    while not store.check([f"join/{t}/challenge"]) and time.time() < deadline:
        time.sleep(0.01)
    challenge = store.get(f"join/{t}/challenge").decode()
    guess = secrets.token_hex(16)
    store.set(f"join/{t}/proof", hmac.new(guess.encode(), f"islands-join|{name}|{challenge}".encode(),
                                          hashlib.sha256).hexdigest())
    while not store.check([f"join/{t}/verdict"]) and time.time() < deadline:
        time.sleep(0.01)
    v = json.loads(store.get(f"join/{t}/verdict"))
    journal.write(json.dumps({"join": json.loads(v["verdict"])["admitted"]}) + "\n")

captured_hb = {}
start = time.time()
seq_hint = 0
job_written = False
latest = 0
while time.time() - start < duration:
    try:
        # the newest epoch: one a member registered in (its own forged "latest" and member lists are no guide)
        while any(store.check([f"e/{latest + 1}/reg/w{i}"]) for i in range(workers)):
            latest += 1
            seq_hint = 0
        while store.check([f"e/{latest}/s/{seq_hint}/done"]):
            seq_hint += 1  # the next operation of the members (found by probing which verdicts exist)
    except Exception:  # the job ended: its store is gone
        break
    names = [f"w{i}" for i in range(workers)]
    # 2. forged admission of "mallory"
    both("forged_admission", "pending", json.dumps([[99, "mallory", 0]]).encode())
    both("forged_admission", "ready/mallory", str(time.time()).encode(), "mallory")
    both("forged_admission", f"e/{latest + 1}/members",
         json.dumps([[i, n, i] for i, n in enumerate(names)] + [[99, "mallory", 0]]).encode())
    both("forged_admission", f"e/{latest + 1}/reg/mallory", b"1", "mallory")
    both("forged_admission", "hb/mallory", str(rng.randrange(10**6)).encode(), "mallory")
    # 3. forged exclusion of one member, and a forged stop of all: dead flags, "fail" verdicts ahead, a far epoch
    both("forged_exclusion", "dead/w1", b"killed by SIGKILL")
    for n in names:
        both("forged_stop", f"dead/{n}", b"finished", n)
    for k in range(seq_hint, seq_hint + 3):
        both("forged_stop", f"e/{latest}/s/{k}/done", b"fail", names[0])
    both("forged_stop", "latest", b"9999", names[0])
    # 4. replays of genuine values: moved to other keys, or written back over newer ones
    genuine_members = raw("e/0/members")
    if genuine_members:
        write("replay", f"e/{latest + 1}/members", genuine_members)
    prev_done = raw(f"e/{latest}/s/{seq_hint - 1}/done") if seq_hint else None
    if prev_done:  # a genuine verdict of the last operation, for the ones ahead
        for k in range(seq_hint, seq_hint + 3):
            write("replay", f"e/{latest}/s/{k}/done", prev_done)
        ok0 = raw(f"e/{latest}/s/{seq_hint - 1}/ok/{names[0]}")
        if ok0:
            write("replay", f"e/{latest}/s/{seq_hint}/ok/{names[0]}", ok0)
    for n in names:
        now_hb = raw(f"hb/{n}")
        old = captured_hb.get(n)
        if old is not None and now_hb is not None and old[1] != now_hb and time.time() - old[0] > 1.0:
            write("replay", f"hb/{n}", old[1])  # an older beat: no progress if refused
            captured_hb[n] = (time.time(), now_hb)
        elif old is None and now_hb is not None:
            captured_hb[n] = (time.time(), now_hb)
    # 5. tampered genuine values: one bit flipped, written back under their own key
    for key in ("e/0/members", f"hb/{names[-1]}", "latest", f"e/{latest}/s/{max(seq_hint - 1, 0)}/done"):
        r = raw(key)
        if r and r.startswith(b"isl1 "):
            write("tampered", key, flip(r))
    # 6. injected state: the job record (what a joiner runs), the next epoch's rendezvous addresses
    if not job_written:
        job = json.dumps({"workers": workers, "heartbeat_timeout": 3.0, "timeout": 60.0, "config": None,
                          "script": ["/tmp/not-yours.py"], "cwd": "/tmp", "job_id": "x"}).encode()
        both("injected_state", "job", job)
        job_written = True
    for r in range(workers):
        both("injected_state", f"pg/{latest + 1}/0/{r}", bytes(rng.randrange(256) for _ in range(64)))
    time.sleep(0.25)
'''


def _attack(address_file: Path, out_path, duration: float, workers: int, log_path) -> subprocess.Popen:
    """The attacker, started before the job and returned once python and torch are imported (on a loaded machine
    that takes longer than a short job lasts); it attacks once `address_file` names the job's store."""
    env = {k: v for k, v in os.environ.items() if k not in ("ISLANDS_TOKEN", "ISLANDS_AUTH_AUDIT")}
    env["OMP_NUM_THREADS"] = "1"
    address_file.unlink(missing_ok=True)
    imported = Path(f"{address_file}.imported")
    imported.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", ATTACKER, str(address_file), str(out_path), str(duration), str(workers), STORE_PREFIX],
        env=env,
        stdout=open(log_path, "w"),  # noqa: SIM115 - the child process writes its log after this returns
        stderr=subprocess.STDOUT,
    )
    while not imported.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the attacker exited with {proc.returncode} before the job started; log in {log_path}")
        time.sleep(0.05)
    return proc


def _joiner_reads_job(address: str, token: str, seen: dict) -> None:
    """What `islands join` does first: read the job record, verified with the token. Once the attacker has
    replaced it, a joiner must refuse it (exit 3), not run the script it names."""
    from islands.control import ControlAuth, JobSpec, Refused, connect

    host, port = address.rsplit(":", 1)
    store = connect(host, int(port))
    try:
        while isinstance(ControlAuth(token, "job", "launcher").open("job", store.get("job")), tuple):
            time.sleep(0.05)
        job = JobSpec.read(store, token, timeout_s=1.0)
        seen["job_read"] = {"tried": 1, "accepted": int("not-yours" in " ".join(job.script))}
    except Refused:
        seen["job_read"] = {"tried": 1, "accepted": 0}
    except Exception as e:  # noqa: BLE001 - the job ended first: not tried
        seen["job_read_error"] = str(e)


def _run(ctx: BenchContext, label: str, base: dict, attack_s: float | None) -> dict:
    run_dir = ctx.out_dir / "runs" / label
    seen: dict = {}

    runs = ctx.out_dir / "runs"  # the attacker's journal and log stay out of the committed results
    address_file = runs / f"attacker-{label}.address"

    def started(address, workers, coordinator):
        seen["coordinator"], seen["address"] = coordinator, address
        if attack_s is not None:
            tmp = address_file.with_suffix(".tmp")
            tmp.write_text(address)
            tmp.rename(address_file)  # the attacker reads it whole
            threading.Thread(
                target=_joiner_reads_job, args=(address, os.environ["ISLANDS_TOKEN"], seen), daemon=True
            ).start()

    if attack_s is not None:
        runs.mkdir(parents=True, exist_ok=True)
        seen["attacker"] = _attack(
            address_file, runs / f"attacks-{label}.jsonl", attack_s, base["workers"], runs / f"attacker-{label}.log"
        )
    os.environ["ISLANDS_AUTH_AUDIT"] = "1"  # every reader keeps when it accepted which (key, value)
    t = time.perf_counter()
    try:
        record = ctx.train_elastic(label, on_started=started, **base)
    except BaseException:
        if seen.get("attacker") is not None:
            seen["attacker"].kill()
            seen["attacker"].wait()
        raise
    finally:
        os.environ.pop("ISLANDS_AUTH_AUDIT", None)
    seconds = time.perf_counter() - t
    out = {"record": record, "seconds": seconds, "members": {}, "audits": {}}
    for p in (run_dir / "elastic").glob("*.json"):
        out["members"][p.stem] = json.loads(p.read_text())
    for p in (run_dir / "elastic").glob("*.audit"):
        out["audits"][p.stem] = json.loads(p.read_text())
    coord = seen["coordinator"]
    out["audits"]["launcher"] = dict(coord.store.accepted_digests or {})
    out["launcher_stats"] = coord.store.snapshot()
    proc = seen.get("attacker")
    if proc is not None:
        proc.terminate()  # the job is over; its journal is complete up to here
        proc.wait(timeout=60)
        journal = (ctx.out_dir / "runs" / f"attacks-{label}.jsonl").read_text().splitlines()
        lines = [json.loads(x) for x in journal if x]
        out["attacks"] = {
            "writes": [x for x in lines if "kind" in x],
            "joins": [x["join"] for x in lines if "join" in x],
        }
        out["job_read"] = seen.get("job_read", {"tried": 0, "accepted": 0, "error": seen.get("job_read_error")})
    del coord
    return out


def _judge(run: dict) -> dict:
    """Per attack kind: writes tried, and how many any reader accepted at or after they were written. An
    accepted replay is either a rollback (the reader went back to a value older than one it held: what replay
    protection must prevent) or a late delivery (a genuine value newer than any the reader had seen for that
    key, e.g. a heartbeat it had not looked at since: it carries the sender's real progress, nothing older)."""
    accepted: dict[str, list] = {}
    for audit in run["audits"].values():
        for d, entry in audit.items():
            if d not in accepted or entry[0] > accepted[d][0]:
                accepted[d] = entry
    kinds: dict[str, dict] = {}
    for w in run["attacks"]["writes"]:
        k = kinds.setdefault(w["kind"], {"tried": 0, "accepted": 0})
        k["tried"] += 1
        entry = accepted.get(w["digest"])
        if entry is not None and entry[0] >= w["t"] - 0.001:
            k["accepted"] += 1
            if w["kind"] == "replay":
                rollback = entry[1] <= entry[2]
                k["rollbacks"] = k.get("rollbacks", 0) + int(rollback)
                k["late_genuine"] = k.get("late_genuine", 0) + int(not rollback)
    joins = run["attacks"]["joins"]
    kinds["join_guessed_token"] = {"tried": len(joins), "accepted": sum(bool(j) for j in joins)}
    kinds["job_record_read_by_joiner"] = run["job_read"]
    return kinds


def _effects(run: dict, workers: int, steps: int) -> dict:
    members = run["members"]
    events = [e for m in members.values() for e in m["final"]["events"]]
    final_members = {n: sorted(x[1] for x in m["final"]["members"]) for n, m in members.items()}
    return {
        "finished": sorted(members),
        "steps": run["record"]["summary"]["steps"],
        "all_finished": sorted(members) == [f"w{i}" for i in range(workers)]
        and run["record"]["summary"]["steps"] == steps,
        "failovers": len({e["epoch"] for e in events if e["type"] == "failure"}),  # each member logs each one
        "final_epochs": sorted({m["final"]["epoch"] for m in members.values()}),
        "mallory_anywhere": any("mallory" in json.dumps(m["final"]) for m in members.values()),
        "members_agree": len({json.dumps(v) for v in final_members.values()}) == 1,
        "digests_agree": len({m["global_sha256"] for m in members.values()}) == 1,
        "refused_by_workers": sum((m.get("control_plane") or {}).get("rejected", 0) for m in members.values()),
        "refused_by_launcher": run["launcher_stats"]["rejected"],
    }


def _store_cost(n: int = 2000) -> dict:
    """Microseconds per set+get of a 64-byte value: the raw store vs through an AuthStore (loopback TCPStore)."""
    from islands.control import AuthStore, ControlAuth

    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )
    raw = dist.PrefixStore(
        "b", dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    )
    authed = AuthStore(raw, ControlAuth("bench-token", "bench-job", "w0"))
    value = b"x" * 64
    out = {}
    for label, store in (("raw", raw), ("authenticated", authed)):
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for i in range(n):
                store.set(f"k{i % 16}", value)
                store.get(f"k{i % 16}")
            best = min(best, (time.perf_counter() - t) / n * 1e6)
        out[label] = best
    del server
    return out


def _etcd_outsiders(tries: int) -> dict | None:
    """Writes and deletes of one key of a job's namespace in an etcd cluster over TLS with client certificates
    (`--store etcds://`), by a client with the cluster's certificate (the control) and by outsiders: plain
    HTTP, TLS without a client certificate, and TLS with a certificate from another CA. An attempt counts as
    accepted when etcd answered 200 or the key no longer holds the job's value. None without etcd or openssl."""
    import base64
    import http.client
    import shutil
    import ssl
    import tempfile
    from pathlib import Path

    from islands.testbed import EtcdCluster

    if shutil.which("openssl") is None or shutil.which("etcd") is None:
        return None
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    key, value = b"islands-bench/islands/e/0/members", b"the job's own value"
    with tempfile.TemporaryDirectory() as tmp:
        cluster = EtcdCluster(1, tls=True).start()
        other = EtcdCluster(1, root=Path(tmp), tls=True)  # its own CA, never started: a foreign certificate
        try:
            host, port = cluster.endpoints[0].split(":")
            env, foreign = cluster.env(), other.env()

            def context(cert: dict | None) -> ssl.SSLContext:
                ctx = ssl.create_default_context(cafile=env["ISLANDS_ETCD_CA"])
                if cert:
                    ctx.load_cert_chain(cert["ISLANDS_ETCD_CERT"], cert["ISLANDS_ETCD_KEY"])
                return ctx

            def call(ctx, path: str, body: dict) -> int:
                conn = (
                    http.client.HTTPConnection(host, int(port), timeout=5)
                    if ctx is None
                    else http.client.HTTPSConnection(host, int(port), timeout=5, context=ctx)
                )
                try:
                    conn.request(
                        "POST",
                        f"/v3/{path}",
                        body=json.dumps(body).encode(),
                        headers={"Content-Type": "application/json"},
                    )
                    return conn.getresponse().status
                except OSError:  # refused in the handshake, or the connection closed on plain HTTP
                    return 0
                finally:
                    conn.close()

            def holds() -> bool:
                conn = http.client.HTTPSConnection(host, int(port), timeout=5, context=context(env))
                conn.request("POST", "/v3/kv/range", body=json.dumps({"key": b64(key)}).encode())
                kvs = json.loads(conn.getresponse().read()).get("kvs", [])
                conn.close()
                return bool(kvs) and base64.b64decode(kvs[0]["value"]) == value

            out = {}
            for label, ctx in (
                ("with the cluster's certificate (control)", context(env)),
                ("plain HTTP", None),
                ("TLS, no client certificate", context(None)),
                ("TLS, a certificate from another CA", context(foreign)),
            ):
                accepted = 0
                for i in range(tries):
                    call(context(env), "kv/put", {"key": b64(key), "value": b64(value)})  # the job's value back
                    op = (
                        ("kv/put", {"key": b64(key), "value": b64(b"forged %d" % i)})
                        if i % 2 == 0
                        else ("kv/deleterange", {"key": b64(key)})
                    )
                    status = call(ctx, *op)
                    accepted += int(status == 200 or not holds())
                out[label] = {"tried": tries, "accepted": accepted}
            return out
        finally:
            other.stop()
            cluster.stop()


def _payload_cost(sizes_mb: list[int]) -> list[dict]:
    """HMAC-SHA256 over a float32 tensor of N MB (MB/s) against a 2-rank gloo all-reduce of it (loopback)."""
    from islands.control import mac_payload

    rows = []
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    for mb in sizes_mb:
        x = torch.randn(mb * 2**20 // 4)
        key = os.urandom(32)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            mac_payload(key, x)
            best = min(best, time.perf_counter() - t)
        times: list[float] = []

        def rank(r, *, mb=mb, x=x, times=times, port=server.port):
            s = dist.PrefixStore(
                f"ar{mb}",
                dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60)),
            )
            pg = dist.ProcessGroupGloo(s, r, 2, datetime.timedelta(seconds=60))
            y = x.clone()
            pg.allreduce([y]).wait()  # warm
            t = time.perf_counter()
            for _ in range(3):
                pg.allreduce([y]).wait()
            if r == 0:
                times.append((time.perf_counter() - t) / 3)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        [th.start() for th in threads]
        [th.join() for th in threads]
        rows.append(
            {
                "mb": mb,
                "hmac_s": best,
                "hmac_mb_per_s": mb / best,
                "allreduce_s": times[0],
                "hmac_over_allreduce": best / times[0],
            }
        )
    del server
    return rows


def _authenticated_training(ctx: BenchContext) -> dict:
    """The same DiLoCo job (byte LM, 2 islands of one worker, loopback) with and without outer.authenticate,
    side by side, in a fixed world and as an elastic job: time blocked in the outer exchange, wall time, bytes."""
    steps, h = (8, 4) if ctx.smoke else (40, 10) if ctx.quick else (300, 20)
    base = dict(
        workers=2,
        islands=2,
        outer=f"diloco:inner_steps={h}",
        steps=steps,
        global_batch=16,
        probe=False,
        eval_every=0,
        **(SMOKE_LM if ctx.smoke else {}),
    )
    runs = {}
    arms = [
        (f"{mode}{label}", extra, mode)
        for mode in ("", "elastic-")
        for label, extra in (("plain", {}), ("authenticated", {"outer.authenticate": True}))
    ]
    for label, extra, mode in arms:  # a fixed world (a wrapped Comm) and an elastic one (ElasticComm's own tags)
        run = ctx.train_elastic if mode else ctx.train
        record = run(f"payload-{label}", **base, **extra, **({"elastic": True} if mode else {}))
        s = record["summary"]
        runs[label] = {
            "wall": s["wall_seconds"],
            "blocked": s["sync_blocked_seconds"],
            "loss": s["final_val_loss"],
            "bytes": sum(record["comm"]["per_rank"][0]["sent"].values()),
        }
    out = {"setting": f"byte LM, {steps} steps, H={h}, {steps // h} exchanges of the whole model", "runs": runs}
    for mode in ("", "elastic-"):
        plain, auth = runs[f"{mode}plain"], runs[f"{mode}authenticated"]
        extra_blocked = auth["blocked"] - plain["blocked"]
        out[mode or "fixed-"] = {
            "extra_blocked": extra_blocked,
            "extra_blocked_pct": 100 * extra_blocked / plain["wall"],
            "extra_bytes": auth["bytes"] - plain["bytes"],
            "same_loss": auth["loss"] == plain["loss"],
        }
    return out


@experiment(
    "control-plane",
    practices=("SOTA-930", "SOTA-934"),
    help="forged, replayed and tampered membership messages and store writes from a process without the "
    "token against a running elastic job: how many are accepted (goal 0); MAC costs",
)
def control_plane(ctx: BenchContext) -> dict:
    workers = 3 if ctx.quick else 4
    steps = 400 if ctx.quick else 1500
    h = 5
    pace: dict = {}
    timeout = 60.0
    if ctx.smoke:  # the attacker needs a job that lasts: 60 steps of at least 0.1 s each (asleep: world.slowdown)
        ctx.smoke_steps, steps, pace = 60, 60, {"slowdown": "floor=0.1"}
        # a verdict the attacker overwrites holds its operation until this timeout (then a fail-over); a short
        # one keeps a few of them inside the smoke lane's 300 s (CI once failed this job after 286 s with the
        # 60 s timeout; its logs were lost, so that cause is a likely one, not a proven one)
        timeout = 15.0
    load_start = os.getloadavg()[0]
    base = dict(
        task="digits",
        workers=workers,
        islands=workers,
        elastic=True,
        outer=f"diloco:inner_steps={h}",
        steps=steps,
        global_batch=8 * workers,
        eval_every=0,
        warmup=10,
        lr=3e-3,
        probe=False,
        timeout=timeout,
        heartbeat_timeout=3.0,
        **pace,
    )
    ctx.plan(6)
    calm = _run(ctx, "no-attacker", base, None)
    # the attacker runs until the job ends (the bench stops it then), or for at most this long: its verdict
    # overwrites can hold the job's last operations in fail-overs for as long as it floods (a denial of service
    # the TCPStore cannot refuse; docs/membership.md), and the experiment must end. The smoke tier's bound leaves
    # its 6 s job room to start on a loaded machine and the whole tier inside the smoke lane's 300 s (CI once
    # spent 287 s in a flood held this way when the smoke bound was the full tier's 300 s)
    attack_s = 40.0 if ctx.smoke else 120.0 if ctx.quick else 300.0
    attacked = _run(ctx, "attacked", base, attack_s)
    kinds = _judge(attacked)
    effects = {"no-attacker": _effects(calm, workers, steps), "attacked": _effects(attacked, workers, steps)}
    store_us = _store_cost(50 if ctx.smoke else 500 if ctx.quick else 2000)
    payload = _payload_cost([1] if ctx.smoke else [1, 16] if ctx.quick else [1, 16, 64])
    outsiders = _etcd_outsiders(5 if ctx.smoke else 20 if ctx.quick else 100)
    trained = _authenticated_training(ctx)
    tried = sum(k["tried"] for k in kinds.values())
    accepted = sum(k["accepted"] for k in kinds.values())
    ctx.log(f"control plane: {accepted} of {tried} attacker values accepted; per kind {kinds}")
    rows = [
        {
            "attack": kind,
            "tried": k["tried"],
            "accepted": k["accepted"],
            "of_which": (
                f"{k.get('rollbacks', 0)} rollbacks, {k.get('late_genuine', 0)} late genuine"
                if kind == "replay"
                else "-"
            ),
        }
        for kind, k in sorted(kinds.items())
    ]
    rows.append({"attack": "all", "tried": tried, "accepted": accepted, "of_which": "-"})
    rollbacks = sum(k.get("rollbacks", 0) for k in kinds.values())
    late = sum(k.get("late_genuine", 0) for k in kinds.values())
    e, c = effects["attacked"], effects["no-attacker"]
    headline = [
        f"{accepted} of {tried} forged, replayed, tampered or injected control values accepted by any reader "
        f"(goal 0): {accepted - late} forged, tampered, moved or rolled back ({rollbacks} rollbacks), {late} "
        "replayed genuine values that reached a reader which had seen no newer value for that key (a heartbeat it "
        "had not read since; the sender's real progress, nothing older than what it held); "
        f"{kinds['join_guessed_token']['accepted']} of {kinds['join_guessed_token']['tried']} joins with a guessed "
        "token admitted",
        f"attacked job: {len(e['finished'])}/{workers} workers finished {e['steps']} steps, {e['failovers']} "
        f"fail-over(s), final epoch(s) {e['final_epochs']}, members agree {e['members_agree']}, global model agrees "
        f"{e['digests_agree']}, the attacker's name in any member's state: {e['mallory_anywhere']}; refusals logged: "
        f"workers {e['refused_by_workers']}, launcher {e['refused_by_launcher']}",
        f"without the attacker (same invocation): {len(c['finished'])}/{workers} finished, {c['failovers']} "
        f"fail-over(s); run time {calm['seconds']:.1f} s vs {attacked['seconds']:.1f} s attacked",
        f"control-plane MAC cost per store set+get (64 B, loopback TCPStore): {store_us['raw']:.0f} us raw vs "
        f"{store_us['authenticated']:.0f} us authenticated",
        "payload MAC (HMAC-SHA256, one core): "
        + "; ".join(
            f"{p['mb']} MB {p['hmac_mb_per_s']:.0f} MB/s = {p['hmac_over_allreduce']:.2f}x a 2-rank gloo all-reduce "
            f"of it"
            for p in payload
        ),
        "authenticated payloads in training (outer.authenticate; "
        + trained["setting"]
        + "): "
        + "; ".join(
            f"{label} wall {r['wall']:.1f} s, blocked in the outer step {r['blocked']:.2f} s, {r['bytes']:,} B sent "
            f"by rank 0"
            for label, r in trained["runs"].items()
        )
        + "; "
        + "; ".join(
            f"{world} world: authentication added {d['extra_blocked']:+.2f} s blocked ({d['extra_blocked_pct']:+.2f}% "
            f"of the plain run's wall), {d['extra_bytes']:,} B (32 B a "
            f"contribution{', 16 B of nonce' if world == 'fixed' else ''}), "
            f"final val loss equal: {d['same_loss']}"
            for world, d in (("fixed", trained["fixed-"]), ("elastic", trained["elastic-"]))
        ),
        (
            "etcd over TLS with client certificates (--store etcds://), writes and deletes of a job key: "
            + "; ".join(f"{label}: {o['accepted']} of {o['tried']} accepted" for label, o in outsiders.items())
            if outsiders
            else "etcd over TLS: not measured (etcd-server or openssl missing)"
        ),
        f"machine load (1-min average) {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on "
        f"{os.cpu_count()} cores (shared with other jobs): times are noisy",
    ]
    return {
        "rows": rows,
        "headline": headline,
        "kinds": kinds,
        "effects": effects,
        "store_us": store_us,
        "payload": payload,
        "authenticated_training": trained,
        "etcd_tls_outsiders": outsiders,
        "seconds": {"no-attacker": calm["seconds"], "attacked": attacked["seconds"]},
        "interconnect": [
            "loopback: launcher, workers and attacker as processes on this machine, gloo and TCPStore over 127.0.0.1"
        ],
        "baseline": [
            "the same elastic job without the attacker, same invocation; the raw store for the MAC "
            "cost; a 2-rank gloo all-reduce of the same bytes for the payload MAC"
        ],
    }
