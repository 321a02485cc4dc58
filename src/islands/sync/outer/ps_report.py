"""What the parameter server's servers did (issue #36), measured where they ran, for the job's run record: run.json's
`parameter_server` section (ParameterServer.run_report, through sync/base.py's `Reports`).

Per server: the CPU seconds it spent, its peak memory, the pushes it received, applied, refused as stale and answered
as duplicates, the windows it stepped (outer steps), goodput (accepted samples / pushed samples) and, in process mode,
the supervisor's restarts of it.

    thread mode (servers=0)     thread_report(loop_state, loop_cpu_seconds): the loop thread's own CPU
                                (time.thread_time inside it); memory: the server state's tensors (no process of its own
                                to measure)
    process mode (servers=S)    each shard server publishes its numbers (server_numbers + process_usage) in the
                                service's store under report/<shard>/<generation> at every heartbeat and once more
                                when it leaves (final); the supervisor, when its servers are gone, collects them with
                                its restarts into DIR/report.json (collect, write_collected); island 0 reads that file
                                after the supervisor exits (read_collected) and sums each shard's processes
                                (process_report)
    elastic, process mode       the island that writes run.json may not be the one that started the service (it may
                                have been killed), so the supervisor hands the report over through its store instead
                                (hand_over) and every island takes it there (take_report); nobody reads the directory;
                                a server host's supervisor (ps_host.ServerHost) hands it over the same way

A process killed before its final report keeps the numbers of its last heartbeat, and a report that never came says
so (`complete` false, `missing`): nothing is filled in with zeros.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

from islands.sync.outer.ps_server import ServerState

REPORT = "report.json"  # the supervisor's collection, in the service's directory
HANDED = "handover/report"  # an elastic job's supervisor's collection, in its store (hand_over)
TAKEN = "handover/taken"  # /<island>: that island has taken it (report_taken)
MEMORY_RSS = "max_rss"  # a server process's peak resident set (getrusage)
MEMORY_STATE = "state_tensors"  # the server state's tensors (ServerState.tensor_bytes: model, optimizer, window)
DEFINITION = (
    "per server: cpu_seconds (thread mode: the server loop thread's CPU, time.thread_time, the receiving thread's "
    "gloo receives not included; process mode: each server process's own CPU, user + system, summed over the "
    "processes a restarted shard had; startup_cpu_seconds of it before serving: interpreter, imports, journal "
    "rebuild), peak_memory_bytes (peak_memory says what: max_rss = the process's peak resident set, the largest of "
    "the shard's processes, startup_max_rss_bytes its peak before serving; state_tensors = the bytes of the server "
    "state's tensors: global model, outer optimizer state, open window at its largest), pushes_received = "
    "pushes_applied + pushes_refused (stale), duplicates (resends answered without applying them; thread mode never "
    "resends), windows_stepped (outer steps), goodput (accepted samples / pushed samples), restarts (process mode: "
    "the supervisor's)"
)


def process_usage() -> dict:
    """This process's CPU seconds so far (user + system) and its peak resident set in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "cpu_seconds": time.process_time(),
        "max_rss_bytes": int(peak if sys.platform == "darwin" else peak * 1024),  # Linux counts KiB, macOS bytes
    }


def server_numbers(state: ServerState, duplicates: int, memory: bool = True) -> dict:
    """A server state's counts as the report words them; `memory`: with its tensors' bytes (clones the outer
    optimizer's state once, so not at every heartbeat)."""
    c = state.counts
    numbers: dict = {
        "pushes_received": int(c["pushes"]),
        "pushes_applied": int(c["pushes"] - c["refused"]),
        "pushes_refused": int(c["refused"]),
        "duplicates": int(duplicates),
        "windows_stepped": int(c["steps"]),
        "samples_accepted": float(c["samples"]),
        "samples_refused": float(c["samples_refused"]),
        "goodput": state.goodput(),
    }
    if memory:
        numbers["state_bytes"] = state.tensor_bytes()
    return numbers


def thread_report(state: ServerState, cpu_seconds: float | None, pulls: dict | None = None) -> dict:
    """The run record's section for the thread mode's one server (`cpu_seconds` None: the loop has not ended;
    `pulls`: its answers' kinds, ps_pulls.HeldCopies.report)."""
    numbers = server_numbers(state, duplicates=0)
    server = {
        "shard": 0,
        "parameters": [0, state.numel],
        "cpu_seconds": cpu_seconds,
        # with compressed pulls, the islands' copies at their largest beside the state (ps_pulls)
        "peak_memory_bytes": numbers["state_bytes"]["total"] + (pulls["peak_bytes"] if pulls is not None else 0),
        "peak_memory": MEMORY_STATE,
        **numbers,
        **({"pulls": pulls} if pulls is not None else {}),
    }
    missing = None if cpu_seconds is not None else "the server loop had not ended: no CPU time"
    return _section("thread", [server], missing)


# ---- process mode -------------------------------------------------------------------------------------------
def report_key(shard: int, gen: int) -> str:
    return f"report/{shard}/{gen}"


def collect(store, servers: int, restarts: list[int], stop: str | None) -> dict:
    """Every shard's process reports the store holds (one per generation that announced itself), with the
    supervisor's restarts per shard, why the service stopped and the supervisor's own usage."""
    shards = []
    for shard in range(servers):
        gens = int(store.add(f"gen/{shard}", 0))
        processes, absent = [], []
        for gen in range(1, gens + 1):
            key = report_key(shard, gen)
            if store.check([key]):
                processes.append(json.loads(store.get(key)))
            else:
                absent.append(gen)
        shards.append({"shard": shard, "restarts": restarts[shard], "processes": processes, "absent": absent})
    return {"shards": shards, "stop": stop, "supervisor": process_usage()}


def write_collected(directory: str | os.PathLike, collected: dict) -> None:
    d = Path(directory)
    tmp = d / (REPORT + ".tmp")
    tmp.write_text(json.dumps(collected))
    os.replace(tmp, d / REPORT)


def read_collected(directory: str | os.PathLike) -> dict | None:
    path = Path(directory) / REPORT
    return json.loads(path.read_text()) if path.is_file() else None


def hand_over(
    store, collected: dict | None, idle_s: float, limit_s: float, clock=time.monotonic, sleep=time.sleep
) -> str:
    """The supervisor of an elastic job's service (its own, or a server host's), its servers gone: publish their
    report (`collected`, None: it wrote none) in its store under HANDED, then keep the store up until every island
    its servers answered final has taken it (report_taken), or no island has beaten for `idle_s` (each beats until
    it has taken it: a killed one beats no more and is not waited for), at most `limit_s`. Which island writes
    run.json is settled only at the job's very end (a member that died is left out there), so every island takes
    it. Returns why it stopped waiting, in words."""
    missing = None if collected is not None else "the supervisor wrote no report"
    store.set(HANDED, json.dumps({"collected": collected, "missing": missing}))
    shards = collected["shards"] if collected is not None else []
    finals = sorted({i for shard in shards for p in shard["processes"] for i in p.get("finals", [])})
    taken = [f"{TAKEN}/{island}" for island in finals]
    beats, since = int(store.add("beats", 0)), clock()
    deadline = since + limit_s
    while clock() < deadline:
        if taken and store.check(taken):
            return f"every island answered final took the report ({len(taken)})"
        now = int(store.add("beats", 0))
        if now != beats:
            beats, since = now, clock()
        elif clock() - since > idle_s:
            return f"no island beat for {idle_s:.0f} s; not taken by island(s) {_untaken(store, finals)}"
        sleep(0.05)
    return f"{limit_s:.0f} s passed; not taken by island(s) {_untaken(store, finals)}"


def _untaken(store, finals: list[int]) -> list[int]:
    return [i for i in finals if not store.check([f"{TAKEN}/{i}"])]


def take_report(calls, store, timeout_s: float, call_s: float) -> tuple[dict | None, str | None]:
    """An island of an elastic job, after asking the service to stop: the servers' report its supervisor hands over
    (hand_over) once they are gone, within `timeout_s`; (None, why) when none came. Every store call runs under
    `calls` (ps_wire.StoreCalls), each within `call_s`: a TCPStore client waits for ever on a stopped master."""
    deadline = time.monotonic() + timeout_s
    try:
        while not calls(lambda: store.check([HANDED]), call_s):
            if time.monotonic() > deadline:
                return None, f"the supervisor handed over no report within {timeout_s:.0f} s"
            time.sleep(0.05)
        handed = json.loads(calls(lambda: store.get(HANDED), call_s))
    except RuntimeError as e:  # a silent store (StoreSilent) or a gone one (DistNetworkError)
        return None, f"the servers' report could not be taken from the service's store: {e}"
    return handed["collected"], handed["missing"]


def report_taken(calls, store, island: int, call_s: float) -> None:
    """Island `island` has the report and has stopped beating: the supervisor need not keep it up for this one."""
    try:
        calls(lambda: store.set(f"{TAKEN}/{island}", "1"), call_s)
    except RuntimeError:  # the supervisor left already (its idle bound or limit): nothing to tell
        pass


def process_report(collected: dict | None, why_missing: str | None = None) -> dict:
    """The run record's section from the supervisor's collection (None: it wrote none, `why_missing` says why).
    Per shard: CPU summed over its processes, peak memory the largest, counts from its latest process (they
    carry over a restart: the journal rebuilds them), duplicates summed (each process counts its own)."""
    if collected is None:
        return _section("processes", [], why_missing or "the supervisor left no report")
    servers: list[dict] = []
    gaps: list[str] = []
    for shard in collected["shards"]:
        servers.append(_shard(shard, gaps))
    section = _section("processes", servers, "; ".join(gaps) or None)
    section["stop"] = collected.get("stop")
    section["supervisor"] = collected.get("supervisor")
    return section


def _shard(shard: dict, gaps: list[str]) -> dict:
    k, processes = shard["shard"], sorted(shard["processes"], key=lambda p: p["gen"])
    for gen in shard["absent"]:
        gaps.append(f"shard {k}'s process of generation {gen} published no report")
    unfinished = [p for p in processes if not p["final"]]
    for p in unfinished:
        gaps.append(
            f"shard {k}'s process {p['pid']} (generation {p['gen']}) ended without its final report: the numbers "
            "of its last heartbeat"
        )
    row: dict = {"shard": k, "restarts": shard["restarts"], "complete": not shard["absent"] and not unfinished}
    if not processes:
        gaps.append(f"no report from shard {k}")
        return {**row, "cpu_seconds": None, "peak_memory_bytes": None, "peak_memory": MEMORY_RSS, "processes": []}
    last = processes[-1]
    counts = {key: last[key] for key in _COUNTS}
    return {
        **row,
        "parameters": last["parameters"],
        "cpu_seconds": sum(p["cpu_seconds"] for p in processes),
        "startup_cpu_seconds": sum(p["startup_cpu_seconds"] for p in processes),
        "peak_memory_bytes": max(p["max_rss_bytes"] for p in processes),
        "startup_max_rss_bytes": max(p["startup_max_rss_bytes"] for p in processes),
        "peak_memory": MEMORY_RSS,
        **counts,
        "duplicates": sum(p["duplicates"] for p in processes),
        **({"state_bytes": last["state_bytes"]} if "state_bytes" in last else {}),
        **({"pulls": _pulls(processes)} if "pulls" in last else {}),
        "processes": [
            {key: p[key] for key in ("gen", "pid", "final", "cpu_seconds", "max_rss_bytes")} for p in processes
        ],
    }


def _pulls(processes: list[dict]) -> dict:
    """A shard's answers by kind over its processes (each counts its own), and the copies its latest held."""
    counted = [p["pulls"] for p in processes if "pulls" in p]
    return {
        "whole": sum(c["whole"] for c in counted),
        "coded": sum(c["coded"] for c in counted),
        "copies": counted[-1]["copies"],
        "peak_bytes": max(c["peak_bytes"] for c in counted),
    }


_COUNTS = (
    "pushes_received",
    "pushes_applied",
    "pushes_refused",
    "windows_stepped",
    "samples_accepted",
    "samples_refused",
    "goodput",
)


def _section(mode: str, servers: list[dict], missing: str | None) -> dict:
    cpu = [s["cpu_seconds"] for s in servers]
    return {
        "mode": mode,
        "complete": missing is None and bool(servers),
        "missing": missing,
        "servers": servers,
        "cpu_seconds": sum(cpu) if servers and None not in cpu else None,
        "restarts": sum(s["restarts"] for s in servers) if mode == "processes" else None,
        "definition": DEFINITION,
    }
