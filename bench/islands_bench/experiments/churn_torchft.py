"""torchft as the reference in `churn`: the same task, events and stall metric, side by side (issue #4).

torchft 0.2.0 is installed into this environment by the bench when missing, like ZipNN in ckpt-codec:
`pip --no-deps`, so it cannot replace our pinned torch; it is not a dependency of islands. Its
package imports opentelemetry at import time (torchft/otel.py, even with telemetry off), so the
pure-Python packages of that import chain are installed with it, pinned and also `--no-deps`.

The common stall metric (`event_stalls`) works on one survivor's committed outer rounds, from our
elastic records and torchft's round logs alike: for an event at time t, take the last round committed
before t and the first round committed after t by a group whose size shows the event (smaller after
a kill, larger after a join); the stall is the longest gap between consecutive commits in that span
minus the survivor's normal round time (median gap between commits before the first event). When an
event comes before the survivor committed the previous event's change (a join released while a kill
is still being absorbed), its span starts at that change instead.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

TORCHFT = "torchft==0.2.0"
# What `import torchft` needs besides torch (0.2.0 declares opentelemetry-api/-sdk/-exporter-otlp-proto-http
# >= 1.39); versions as pip resolved them on 2026-11-29 with torch 2.13.0 installed.
TORCHFT_IMPORT_DEPS = (
    "opentelemetry-api==1.45.2",
    "opentelemetry-sdk==1.45.2",
    "opentelemetry-semantic-conventions==0.66b2",
    "opentelemetry-proto==1.45.2",
    "opentelemetry-exporter-otlp-proto-common==1.45.2",
    "opentelemetry-exporter-otlp-proto-http==1.45.2",
    "opentelemetry-exporter-http-transport==0.66b2",
    "opentelemetry-exporter-otlp-common==0.66b2",
    "googleapis-common-protos==1.76.0",
    "protobuf==7.36.2",
    "requests==2.34.2",
    "urllib3==2.8.0",
    "idna==3.20",
    "certifi==2026.10.19.post1",
    "charset-normalizer==3.5.3",
)


@dataclass(frozen=True)
class TorchftSettings:
    """torchft's fault-tolerance knobs in the reference run; the lighthouse ones are its defaults."""

    heartbeat_timeout_ms: int = 5000  # lighthouse default: a replica is dead after 5 s without a heartbeat
    heartbeat_interval_ms: int = 100  # Manager default
    join_timeout_ms: int = 60000  # lighthouse default: how long a quorum waits for heartbeating stragglers
    quorum_tick_ms: int = 100  # lighthouse default
    timeout_s: float = 60.0  # Manager timeout (collectives, RPCs): our job's collective timeout
    quorum_timeout_s: float = 60.0

    def describe(self) -> str:
        return (
            f"lighthouse heartbeat_timeout_ms={self.heartbeat_timeout_ms}, join_timeout_ms={self.join_timeout_ms}, "
            f"quorum_tick_ms={self.quorum_tick_ms} (defaults); Manager heartbeat_interval="
            f"{self.heartbeat_interval_ms} ms, timeout={self.timeout_s:g} s, quorum_timeout={self.quorum_timeout_s:g} "
            "s, "
            "use_async_quorum=False, min_replica_size=1, ProcessGroupGloo"
        )


def load_torchft(log) -> tuple[str | None, str | None]:
    """(torchft version, None) when importable (installing it if missing), else (None, why not)."""
    try:
        importlib.import_module("torchft")
        return _version(), None
    except ImportError as exc:
        first = f"{type(exc).__name__}: {exc}"
    log(f"torchft not importable ({first}); installing {TORCHFT} into {sys.prefix} (pip --no-deps) ...")
    for group in ([TORCHFT], list(TORCHFT_IMPORT_DEPS)):
        out = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", *group], capture_output=True, text=True, timeout=900
        )
        if out.returncode != 0:
            return None, f"pip install --no-deps {' '.join(group)} failed: {out.stderr.strip().splitlines()[-1:]}"
    importlib.invalidate_caches()
    try:
        importlib.import_module("torchft")
        return _version(), None
    except ImportError as exc:
        return None, f"torchft installed but `import torchft` failed: {type(exc).__name__}: {exc}"


def _version() -> str:
    import importlib.metadata

    return importlib.metadata.version("torchft")


# ---- the metric (pure; unit-tested without torchft) ------------------------------------------------


def read_round_log(path: Path) -> list[dict]:
    """A replica's JSON lines; a line cut by SIGKILL mid-write is dropped."""
    rows = []
    for line in Path(path).read_text().splitlines() if Path(path).exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def torchft_commits(rows: list[dict]) -> list[tuple[float, int]]:
    """(time, group size) of each committed round in a torchft replica's log."""
    return [(r["t"], r["participants"]) for r in rows if not r.get("final") and r["committed"]]


def islands_commits(member: dict) -> list[tuple[float, int]]:
    """(time, group size) of each committed outer exchange in one of our elastic worker records."""
    syncs = [s for s in member["syncs"] if s["kind"] == "outer_delta"]
    return sorted((s["start"] + s["seconds"], s["size"]) for s in syncs)


def event_stalls(commits: list[tuple[float, int]], events: list[tuple[float, str]]) -> list[dict]:
    """Per event ("kill" or "join" at a wall time), this survivor's stall; see the module docstring."""
    if len(commits) < 3:
        raise ValueError(f"need at least 3 committed rounds to measure a stall, got {len(commits)}")
    if any(kind not in ("kill", "join") for _, kind in events):
        raise ValueError(f"event kinds must be 'kill' or 'join', got {[k for _, k in events]}")
    times = [t for t, _ in commits]
    first_event = min((t for t, _ in events), default=times[-1])
    calm = [b - a for a, b in itertools.pairwise(times) if b <= first_event]
    if not calm:
        raise ValueError("no committed rounds before the first event: no normal round time to subtract")
    if [t for t, _ in events] != sorted(t for t, _ in events):
        raise ValueError("events must be given in time order")
    normal = statistics.median(calm)
    out, floor = [], 0
    for t_event, kind in events:
        before = [i for i, t in enumerate(times) if t <= t_event]
        if not before:
            raise ValueError(f"event at {t_event} precedes this survivor's first committed round")
        # an event that comes before this survivor committed the previous event's change starts from that change
        i0 = max(before[-1], floor)
        size0 = commits[i0][1]
        shows = (lambda s, size0=size0: s < size0) if kind == "kill" else (lambda s, size0=size0: s > size0)
        i1 = next((i for i in range(i0 + 1, len(commits)) if shows(commits[i][1])), None)
        row = {"kind": kind, "time": t_event, "normal_round_s": normal, "reflected": i1 is not None}
        if i1 is not None:
            gap = max(b - a for a, b in zip(times[i0:i1], times[i0 + 1 : i1 + 1]))
            row.update(
                longest_gap_s=gap,
                stall_s=max(gap - normal, 0.0),
                rounds_until_reflected=i1 - i0,
                size_before=size0,
                size_after=commits[i1][1],
            )
            floor = i1
        out.append(row)
    return out


def join_wait_rounds(commits: list[tuple[float, int]], ready_t: float) -> int | None:
    """Rounds a survivor committed after the joiner was ready (its Manager up) and before one included it."""
    before = [size for t, size in commits if t <= ready_t]
    if not before:
        raise ValueError("the joiner was ready before this survivor's first committed round")
    after = [(t, size) for t, size in commits if t > ready_t]
    first_with = next((i for i, (_, size) in enumerate(after) if size > before[-1]), None)
    return first_with


def stalls_over_survivors(per_survivor: dict[str, list[dict]]) -> list[dict]:
    """Max and mean stall per event over the survivors that saw it reflected."""
    names = sorted(per_survivor)
    out = []
    for i, first in enumerate(per_survivor[names[0]]):
        seen = [per_survivor[n][i] for n in names if per_survivor[n][i]["reflected"]]
        stalls = [r["stall_s"] for r in seen]
        out.append(
            {
                "kind": first["kind"],
                "time": first["time"],
                "survivors": len(seen),
                "max_stall_s": max(stalls) if stalls else None,
                "mean_stall_s": sum(stalls) / len(stalls) if stalls else None,
                "max_longest_gap_s": max(r["longest_gap_s"] for r in seen) if seen else None,
            }
        )
    return out


# ---- the run ---------------------------------------------------------------------------------------

_LIGHTHOUSE = """
import json, sys, time
from torchft._torchft import LighthouseServer
server = LighthouseServer(bind="[::]:" + sys.argv[2], min_replicas=1, **json.loads(sys.argv[1]))
print(server.address().rsplit(":", 1)[1], flush=True)
while True:
    time.sleep(3600)
"""


class Lighthouse:
    """torchft's Lighthouse in a process of its own, restartable on the port it first got."""

    def __init__(self, run_dir: Path, settings: TorchftSettings):
        self.run_dir, self.settings = run_dir, settings
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> Lighthouse:
        knobs = json.dumps(
            {
                "join_timeout_ms": self.settings.join_timeout_ms,
                "quorum_tick_ms": self.settings.quorum_tick_ms,
                "heartbeat_timeout_ms": self.settings.heartbeat_timeout_ms,
            }
        )
        log = self.run_dir / "logs" / ("lighthouse.log" if not self.starts else f"lighthouse.{self.starts}.log")
        for _ in range(50 if self.port else 1):  # a restart on the same port may find it still held for a moment
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _LIGHTHOUSE, knobs, str(self.port)],
                stdout=subprocess.PIPE,
                stderr=open(log, "w"),  # noqa: SIM115 - the child process writes its log after this returns
                text=True,
            )
            port = self.proc.stdout.readline().strip()
            if port.isdigit():
                self.port, self.starts = int(port), self.starts + 1
                return self
            self.proc.kill()
            self.proc.wait()
            time.sleep(0.1)
        raise RuntimeError(f"torchft lighthouse did not start on port {self.port}: {log.read_text()[-600:]}")

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def _wait(cond, limit_s: float, what: str, procs=()) -> None:
    deadline = time.time() + limit_s
    while not cond():
        dead = [p for p in procs if p.poll() not in (None, 0)]
        if dead:
            raise RuntimeError(f"torchft replica exited with {dead[0].poll()} while waiting for {what}")
        if time.time() > deadline:
            raise TimeoutError(f"torchft run: {what} did not happen within {limit_s:.0f} s")
        time.sleep(0.01)


def _latest_step(path: Path) -> int:
    rows = [r for r in read_round_log(path) if not r.get("final")]
    return rows[-1]["step"] if rows else 0


def run_torchft(
    cfg,
    run_dir: Path,
    workers: int,
    inner_steps: int,
    plan: dict | None,
    settings: TorchftSettings = TorchftSettings(),
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    limit_s: float = 900.0,
    log=print,
) -> dict:
    """Run `workers` torchft replicas (plus a joiner when `plan`), inject `plan`'s events; return the logs.

    plan = {"kills": [round, ...], "join": round}: a kill SIGKILLs the last not-yet-killed replica once
    replica r0 has committed that round; the joiner (pre-started with torch loaded, taking the first
    victim's shard) is released once r0 has committed the join round. Mirrors our churn run.
    """
    from islands.config import dump_json

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    dump_json(cfg, run_dir / "config.json")
    rounds = cfg.train.steps // inner_steps
    # the lighthouse in its own process: its Rust log goes to a file, and a replica's death cannot touch it
    lighthouse = Lighthouse(run_dir, settings).start()
    address = lighthouse.address
    barrier = run_dir / "go-all"
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, shard: int, go: Path | None) -> None:
        spec = {
            "config": str(run_dir / "config.json"),
            "lighthouse": address,
            "name": name,
            "shard": shard,
            "shards": workers,
            "inner_steps": inner_steps,
            "rounds": rounds,
            "outer_lr": outer_lr,
            "outer_momentum": outer_momentum,
            "log": str(run_dir / f"{name}.jsonl"),
            "go": str(go) if go else None,
            "barrier": None if go else str(barrier),
            "start_limit_s": limit_s,
            "timeout_s": settings.timeout_s,
            "quorum_timeout_s": settings.quorum_timeout_s,
            "heartbeat_interval_ms": settings.heartbeat_interval_ms,
        }
        (run_dir / f"{name}.spec.json").write_text(json.dumps(spec))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        procs[name] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "islands_bench.experiments.churn_torchft_worker",
                str(run_dir / f"{name}.spec.json"),
            ],
            env=env,
            stdout=open(run_dir / "logs" / f"{name}.log", "w"),  # noqa: SIM115 - the child process writes its log after this returns
            stderr=subprocess.STDOUT,
        )

    events: list[dict] = []
    try:
        started = time.time()
        for i in range(workers):
            start(f"r{i}", i, None)
        victims = [f"r{i}" for i in range(workers - 1, 0, -1)]  # never r0: its log keeps the whole curve
        if plan:
            start("j1", workers - 1, run_dir / "go-j1")  # takes over the first victim's shard
        everyone = list(procs.values())
        _wait(
            lambda: all((run_dir / f"r{i}.jsonl.ready").exists() for i in range(workers)),
            limit_s,
            "all replicas ready",
            everyone,
        )
        barrier.write_text(str(time.time()))
        lead = run_dir / "r0.jsonl"
        todo = sorted([(r, "kill") for r in (plan or {}).get("kills", [])] + ([(plan["join"], "join")] if plan else []))
        for rnd, kind in todo:
            _wait(lambda rnd=rnd: _latest_step(lead) >= rnd, limit_s, f"round {rnd} on r0", [procs["r0"]])
            if kind == "kill":
                name = victims.pop(0)
                procs[name].send_signal(signal.SIGKILL)
                events.append({"kind": "kill", "name": name, "round": rnd, "time": time.time()})
            else:
                events.append({"kind": "join", "name": "j1", "round": rnd, "time": time.time()})
                (run_dir / "go-j1").write_text(str(time.time()))
        killed = {e["name"] for e in events if e["kind"] == "kill"}
        for name, proc in procs.items():
            if name in killed:
                proc.wait(timeout=30)
                continue
            code = proc.wait(timeout=max(limit_s - (time.time() - started), 1.0))
            if code != 0:
                tail = (run_dir / "logs" / f"{name}.log").read_text()[-1500:]
                raise RuntimeError(f"torchft replica {name} exited with {code}; log tail:\n{tail}")
        seconds = time.time() - started
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        lighthouse.kill()
    logs = {name: read_round_log(run_dir / f"{name}.jsonl") for name in procs}
    ready = {
        name: float((run_dir / f"{name}.jsonl.ready").read_text())
        for name in procs
        if (run_dir / f"{name}.jsonl.ready").exists()
    }
    result = {"events": events, "logs": logs, "ready": ready, "seconds": seconds, "settings": asdict(settings)}
    (run_dir / "events.json").write_text(
        json.dumps({"events": events, "settings": asdict(settings), "seconds": seconds}, indent=1)
    )
    return result


def summarise_torchft(run: dict) -> dict:
    """Stalls (common metric) per event over the original replicas that finished, final loss, group size."""
    logs, events = run["logs"], run["events"]
    finished = {n: rows for n, rows in logs.items() if rows and rows[-1].get("final")}
    survivors = {n: rows for n, rows in finished.items() if n != "j1"}
    marks = [(e["time"], e["kind"]) for e in events]
    per = {n: event_stalls(torchft_commits(rows), marks) for n, rows in survivors.items()} if marks else {}
    lead = logs["r0"]
    commits = [r for r in lead if not r.get("final") and r["committed"]]
    failed = sum(1 for r in lead if not r.get("final") and not r["committed"])
    out = {
        "stalls": stalls_over_survivors(per) if per else [],
        "final_val_loss": lead[-1]["val_loss"],
        "final_workers": commits[-1]["participants"],
        "failed_rounds_r0": failed,
        "curve": [{"step": r["step"], "loss": r["loss"]} for r in commits],
    }
    if "j1" in run["ready"]:
        joined = [r for r in logs["j1"] if not r.get("final") and r["committed"] and r["participants"] > 1]
        out["join"] = {
            "ready_after_release_s": run["ready"]["j1"] - next(e["time"] for e in events if e["kind"] == "join"),
            "rounds_without_it_after_ready": join_wait_rounds(torchft_commits(lead), run["ready"]["j1"]),
            "contributed_rounds": len(joined),
        }
    return out
