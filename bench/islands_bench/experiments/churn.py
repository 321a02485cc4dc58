"""churn: kill two workers and add one during an elastic DiLoCo run; survivors' stall and the joiner's wait.

Side by side in one invocation: the same job without churn (the loss it should track). Stall per
failure = on each survivor, the time from detecting the failure to committing the retried exchange;
the joiner's wait = rounds committed after its admission that did not yet include it (goal <= 1).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from islands_bench.experiments.churn_torchft import (
    TorchftSettings,
    event_stalls,
    islands_commits,
    load_torchft,
    run_torchft,
    stalls_over_survivors,
    summarise_torchft,
)
from islands_bench.harness import BenchContext, experiment

# The elastic job's coordinator keeps its keys under this prefix (islands.runtime.elastic.membership's protocol,
# docs/membership.md); the experiment watches them to time its kills and its join.
STORE_PREFIX = "islands"
# The outer step of our elastic run: torchft's side runs Nesterov SGD lr 0.7, momentum 0.9 (LIT-212), so ours is
# given the same one explicitly (DiLoCo's own default is the plain lr sqrt(2) step, docs/outer-strategies.md).
PAPER_OUTER = "outer=nesterov,outer_lr=0.7,momentum=0.9"

_JOINER = """
import datetime, pathlib, sys, time
import torch.distributed as dist
import sklearn.datasets, islands.app.elastic_worker as ew
up, address_file = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
up.write_text("imported")
while not address_file.exists():
    time.sleep(0.01)
address = address_file.read_text()
host, port = address.rsplit(":", 1)
store = dist.PrefixStore(sys.argv[4], dist.TCPStore(host, int(port), is_master=False,
                                                   timeout=datetime.timedelta(seconds=30)))
while not store.check(["bench/go"]):
    time.sleep(0.01)
ew.exit_now(ew.main([address, sys.argv[3]]))
"""


def _start_joiner(ctx: BenchContext, label: str, token: str) -> tuple[subprocess.Popen, Path]:
    """The joiner, started before the job and returned once python, torch and islands are imported: its start-up
    (tens of seconds on a loaded machine) would otherwise race the job's end, and a short job ended first. It
    waits for the job's address in the returned file, then for the experiment's go."""
    side = Path(ctx.out_dir) / "runs" / f"{label}.joiner"  # beside the run directory, which the job recreates
    shutil.rmtree(side, ignore_errors=True)
    side.mkdir(parents=True)
    up, address_file = side / "imported", side / "address"
    env = dict(os.environ, ISLANDS_NAME="j1", ISLANDS_TOKEN=token, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _JOINER,
            str(up),
            str(address_file),
            str(ctx.out_dir / "runs" / label / "joiner"),
            STORE_PREFIX,
        ],
        env=env,
        stdout=open(side / "j1.log", "w"),  # noqa: SIM115 - the child process writes its log after this returns
        stderr=subprocess.STDOUT,
    )
    while not up.exists():
        if proc.poll() is not None:
            raise RuntimeError(
                f"the joiner exited with {proc.returncode} before the job started; log in {side / 'j1.log'}"
            )
        time.sleep(0.05)
    return proc, address_file


def job_store(address: str, token: str):
    """A client of the elastic job's coordinator store at HOST:PORT, seeing the job's own keys; its values are
    signed under the job token (docs/membership.md "Security"), so the view verifies them with it."""
    from islands.control import observe_job

    return observe_job(address, token)


def _get_json(store, key: str, default=None):
    return json.loads(store.get(key)) if store.check([key]) else default


def _events(ctx: BenchContext, address: str, workers, kills: list[int], join_at: int, log: dict) -> None:
    store = job_store(address, log["token"])

    def wait(key):
        while not store.check([key]):
            time.sleep(0.01)

    wait("e/0/members")
    tmp = log["address_file"].with_suffix(".tmp")  # the pre-started joiner reads it whole
    tmp.write_text(address)
    tmp.rename(log["address_file"])
    members = [m[1] for m in json.loads(store.get("e/0/members"))]
    victims = members[-len(kills) :]  # never the first member, so one record keeps the whole curve
    plan = sorted([(r, "kill", v) for r, v in zip(kills, victims)] + [(join_at, "join", "j1")])
    for rnd, what, name in plan:
        wait(f"round/{rnd}/join")
        if what == "kill":
            next(w for w in workers if f"w{w.rank}" == name).proc.send_signal(signal.SIGKILL)
            log.setdefault("kills", []).append({"name": name, "round": rnd, "time": time.time()})
        else:
            proc = log["joiner"]
            log["released"] = time.time()
            store.set("bench/go", "1")  # the pre-started joiner asks to join now
            while not any(p[1] == name for p in _get_json(store, "pending", [])) and proc.poll() is None:
                time.sleep(0.01)
            log["join"] = {"name": name, "asked_round": rnd, "admitted": time.time(), "proc": proc}
            while not store.check([f"ready/{name}"]) and proc.poll() is None:
                time.sleep(0.01)
            log["ready"] = float(store.get(f"ready/{name}")) if store.check([f"ready/{name}"]) else float("nan")


def _run(ctx: BenchContext, label: str, cfg_values: dict, churn: dict | None) -> dict:
    run_dir = ctx.out_dir / "runs" / label
    log: dict = {"join_dir": run_dir / "joiner"}

    def started(address, workers, coordinator):
        log["token"] = os.environ["ISLANDS_TOKEN"]
        if churn:
            threading.Thread(
                target=_events, args=(ctx, address, workers, churn["kills"], churn["join"], log), daemon=True
            ).start()

    ctx.log(f"run {label}: churn={churn}")
    if churn:
        os.environ.setdefault("ISLANDS_TOKEN", os.urandom(16).hex())  # the job's token (train_elastic keeps it)
        log["joiner"], log["address_file"] = _start_joiner(ctx, label, os.environ["ISLANDS_TOKEN"])
    try:
        record = ctx.train_elastic(label, on_started=started, **cfg_values)
    finally:
        if churn and "join" not in log and log["joiner"].poll() is None:
            log["joiner"].kill()  # never asked: it would wait for the go forever
            log["joiner"].wait()
    if churn and "join" not in log:
        raise RuntimeError(
            f"churn run {label!r}: the joiner was not admitted before the job ended; "
            f"make the run longer (logs in {run_dir / 'logs'})"
        )
    if "join" in log:
        log["join"]["proc"].wait(timeout=120)
        log["join"].pop("proc")
    members = {p.stem: json.loads(p.read_text()) for p in run_dir.glob("elastic/*.json")}
    members.update({p.stem: json.loads(p.read_text()) for p in (run_dir / "joiner").glob("elastic/*.json")})
    return {"record": record, "members": members, "log": log, "ready": log.get("ready")}


def _summarise(run: dict) -> dict:
    members, log = run["members"], run["log"]
    stalls = []
    for kill in log.get("kills", []):
        per = [
            e["stall_seconds"]
            for m in members.values()
            for e in m["final"]["events"]
            if e["type"] == "failure" and kill["name"] in e["gone"]
        ]
        stalls.append(
            {
                "killed": kill["name"],
                "round": kill["round"],
                "survivors": len(per),
                "max_stall_s": max(per),
                "mean_stall_s": sum(per) / len(per),
            }
        )
    out = {
        "stalls": stalls,
        "digests_agree": len({m["global_sha256"] for m in members.values()}) == 1,
        "final_workers": run["record"]["summary"]["workers"],
    }
    join = log.get("join")
    if join:
        lead = members[min(members, key=lambda n: members[n]["slot"])]
        rounds = [s for s in lead["syncs"] if s["kind"] == "outer_delta"]
        entered = next((e["resumed"] for e in lead["final"]["events"] if e["type"] == "join"), None)
        if entered is None:
            raise RuntimeError("the joiner was admitted but never entered: the job ended first; make the run longer")
        # rounds committed after the admission and before the joiner was in the group
        ready = float(run["ready"])
        first_with = sum(1 for s in rounds if ready < s["start"] + s["seconds"] and s["start"] < entered)
        joiner = members[join["name"]]
        join_stall = [e["stall_seconds"] for m in members.values() for e in m["final"]["events"] if e["type"] == "join"]
        out["join"] = {
            "rounds_without_it_after_ready": first_with,
            "ready_after_admission_s": ready - join["admitted"],
            "contributed_rounds": sum(1 for s in joiner["syncs"] if s["kind"] == "outer_delta"),
            "members_stall_s": max(join_stall),
        }
    # the common metric, as for torchft (churn_torchft.event_stalls): gaps between committed rounds
    marks = [(k["time"], "kill") for k in log.get("kills", [])] + ([(log["released"], "join")] if join else [])
    per = {n: event_stalls(islands_commits(m), marks) for n, m in members.items() if not join or n != join["name"]}
    out["round_gap_stalls"] = stalls_over_survivors(per)
    return out


def _torchft_side(ctx: BenchContext, base: dict, workers: int, h: int, plan: dict) -> dict:
    """torchft's calm and churned runs on the same task, or why they could not run."""
    version, why = load_torchft(ctx.log)
    if version is None:
        ctx.log(f"torchft not run: {why}")
        return {"error": why}
    settings = TorchftSettings(timeout_s=base["timeout"])
    out = {"version": version, "settings": settings.describe()}
    # smoke: the churned run alone (the calm one is the same job without its events)
    for label, events in ((("torchft-no-churn", None),) if not ctx.smoke else ()) + (("torchft-churn", plan),):
        run_dir = ctx.out_dir / "runs" / label
        shutil.rmtree(run_dir, ignore_errors=True)
        ctx.log(f"run {label}: {workers} torchft {version} replicas, DiLoCo H={h}, churn={events}")
        try:
            run = run_torchft(
                ctx.config(run_dir=str(run_dir), **base), run_dir, workers, h, events, settings, log=ctx.log
            )
        except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as exc:
            ctx.log(f"torchft run {label} failed: {exc}")  # ours stands; say exactly why torchft's row is missing
            return {"error": f"torchft {version} run {label} failed: {type(exc).__name__}: {exc}"[:600]}
        out[label] = {**summarise_torchft(run), "events": run["events"], "seconds": run["seconds"]}
    return out


def _plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    k = 10  # per-round losses of an 8-sample batch are noisy: plot a running mean over 10 rounds
    for label, series in result["curves"].items():
        loss = [p["loss"] for p in series]
        mean = [sum(loss[max(0, i - k + 1) : i + 1]) / len(loss[max(0, i - k + 1) : i + 1]) for i in range(len(loss))]
        ax.plot([p["step"] for p in series], mean, label=label, lw=1)
    for step, text in result["event_steps"]:
        ax.axvline(step, color="grey", ls=":")
        ax.text(step, ax.get_ylim()[1], text, fontsize=7, rotation=90, va="top")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss, first worker, mean of 10 rounds")
    ax.set_yscale("log")
    ax.set_title("churn: DiLoCo, workers killed and joined mid-run (islands elastic vs torchft)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _gap_cols(stalls: list[dict]) -> dict:
    """Row columns of the common metric: one per event (kill1, kill2, join), max over survivors."""
    cols, kills = {}, 0
    for s in stalls:
        kills += s["kind"] == "kill"
        key = f"kill{kills}" if s["kind"] == "kill" else "join"
        cols[f"{key}_stall_s"] = s["max_stall_s"] if s["max_stall_s"] is not None else "not reflected"
    return cols


def _stall_text(stalls: list[dict]) -> str:
    return ", ".join(
        f"{s['kind']} {s['max_stall_s']:.2f} s" if s["max_stall_s"] is not None else f"{s['kind']} not reflected"
        for s in stalls
    )


@experiment(
    "churn",
    practices=("SOTA-155", "Q-4"),
    help="kill two workers and add one during elastic DiLoCo, torchft side by side: survivors' stall, "
    "joiner's wait, loss curve",
)
def churn(ctx: BenchContext) -> dict:
    workers = 4 if ctx.quick else 8  # issue #4: kill two of eight workers and add one
    load_start = os.getloadavg()[0]
    h = 5
    pace = {}
    if ctx.smoke:  # the kills and the join need rounds to happen in, and the joiner time to enter before the end:
        # every step lasts at least 50 ms (asleep: world.slowdown's floor), so 300 steps outlast a loaded start-up
        ctx.smoke_steps, pace = 300, {"slowdown": "floor=0.05"}
    base = dict(
        task="digits",
        workers=workers,
        islands=workers,
        elastic=True,
        outer=f"diloco:inner_steps={h},{PAPER_OUTER}",
        steps=ctx.smoke_steps if ctx.smoke else 1500 if ctx.quick else 2400,
        global_batch=8 * workers,
        eval_every=50,
        warmup=10,
        lr=3e-3,
        probe=False,
        timeout=60.0,
        heartbeat_timeout=3.0,
        log_every=h,
        **pace,
    )
    rounds = base["steps"] // h
    # the joiner is started right after the second kill; python+torch start-up decides when it is admitted
    plan = {"kills": [rounds // 6, 2 * rounds // 6], "join": 2 * rounds // 6 + 1}
    calm = _run(ctx, "no-churn", base, None)
    churned = _run(ctx, "churn", base, plan)
    summary = _summarise(churned)
    ft = _torchft_side(ctx, base, workers, h, plan)
    j = summary["join"]
    calm_cols = {k: "-" for k in _gap_cols(summary["round_gap_stalls"])}
    rows = [
        {
            "run": "islands no-churn",
            "final_val_loss": calm["record"]["summary"]["final_val_loss"],
            "final_workers": workers,
            **calm_cols,
            "join_wait_rounds": "-",
            "detect_to_commit_max_s": "-",
        },
        {
            "run": "islands churn",
            "final_val_loss": churned["record"]["summary"]["final_val_loss"],
            "final_workers": summary["final_workers"],
            **_gap_cols(summary["round_gap_stalls"]),
            "join_wait_rounds": j["rounds_without_it_after_ready"],
            "detect_to_commit_max_s": max(s["max_stall_s"] for s in summary["stalls"]),
        },
    ]
    headline = [
        f"{workers} workers, two SIGKILLed (rounds {plan['kills']}) and one started at round {plan['join']}: the job "
        f"finished with {summary['final_workers']} workers and survivors agreed bitwise: {summary['digests_agree']}",
        "islands survivors' stall per event (longest gap between committed rounds, from the last before the event to "
        "the first by the changed group, minus a normal round; max over survivors): "
        + _stall_text(summary["round_gap_stalls"])
        + " (goal: < 2 s); detect -> retried exchange committed: "
        + ", ".join(f"{s['killed']} {s['max_stall_s']:.2f} s" for s in summary["stalls"]),
        f"islands joiner: ready (trainer built) {j['ready_after_admission_s']:.2f} s after admission; "
        f"{j['rounds_without_it_after_ready']} round(s) committed after it was ready without it (goal <= 1), then "
        f"contributed to {j['contributed_rounds']} rounds; members paused {j['members_stall_s']:.2f} s "
        "to form the new group and send it the state",
        f"islands final val loss {rows[1]['final_val_loss']:.4f} with churn vs {rows[0]['final_val_loss']:.4f} without",
    ]
    curves = {
        "islands no churn": calm["record"]["series"]["train"],
        "islands churn": churned["record"]["series"]["train"],
    }
    if "error" in ft:
        headline.append(f"torchft not run side by side: {ft['error']}")
    else:
        fc, fq = ft["torchft-churn"], ft.get("torchft-no-churn")  # smoke: no calm torchft run
        rows += (
            [
                {
                    "run": f"torchft {ft['version']} no-churn",
                    "final_val_loss": fq["final_val_loss"],
                    "final_workers": fq["final_workers"],
                    **calm_cols,
                    "join_wait_rounds": "-",
                }
            ]
            if fq
            else []
        )
        rows += [
            {
                "run": f"torchft {ft['version']} churn",
                "final_val_loss": fc["final_val_loss"],
                "final_workers": fc["final_workers"],
                **_gap_cols(fc["stalls"]),
                "join_wait_rounds": fc["join"]["rounds_without_it_after_ready"],
                "detect_to_commit_max_s": "no counterpart",
            }
        ]
        headline += [
            f"torchft {ft['version']} side by side (same task, model, data shards, inner/outer optimizers, H={h}, "
            f"events at the same rounds; one replica group per worker, its DiLoCo wrapper): survivors' stall "
            f"{_stall_text(fc['stalls'])} (same metric); joiner: {fc['join']['rounds_without_it_after_ready']} "
            f"round(s) without it after it was ready, then contributed to {fc['join']['contributed_rounds']} rounds; "
            f"final val loss {fc['final_val_loss']:.4f} with churn vs "
            + (f"{fq['final_val_loss']:.4f} without" if fq else "(no calm run in the smoke tier)"),
            f"torchft settings: {ft['settings']}",
        ]
        for label, run in (("torchft no churn", fq), ("torchft churn", fc)):  # its log counts rounds: step = round*H
            if run is None:
                continue
            curves[label] = [{"step": p["step"] * h, "loss": p["loss"]} for p in run.pop("curve")]
    headline.append(
        f"machine load (1-min average) {load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the "
        f"end, on {os.cpu_count()} cores: absolute times are noisy; all four runs shared it"
    )
    event_steps = [(k["round"] * h, f"kill {k['name']}") for k in churned["log"]["kills"]]
    lead = churned["members"][min(churned["members"], key=lambda n: churned["members"][n]["slot"])]
    admitted = churned["log"]["join"]["admitted"]
    before = sum(1 for x in lead["syncs"] if x["kind"] == "outer_delta" and x["start"] + x["seconds"] <= admitted)
    event_steps.append((before * h, "j1 admitted"))
    return {
        "rows": rows,
        "headline": headline,
        "plot": _plot,
        "summary": summary,
        "plan": plan,
        "torchft": ft,
        "curves": curves,
        "event_steps": event_steps,
        "interconnect": ["loopback, one process per worker (islands) or replica (torchft) on this machine"],
        "baseline": ["the same job without churn; torchft 0.2.0 with the same task and events, same invocation"],
    }
