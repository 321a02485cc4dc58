"""parameter-server (issue #36): synchronous DiLoCo, DiLoCo with deadline rounds and the parameter server side by
side, judged by the wall time to a target loss (SOTA-907, SOTA-912, SOTA-910).

Arms (the same step budget per island, evaluated at every round's end; rank 0 sits on the fastest island):
    diloco           synchronous rounds of H steps: every island waits for the slowest at each exchange
    diloco-deadline  adapt=deadline: every island steps until the fastest island's time for H steps runs out
    ps               the parameter server (ps:inner_steps=H; a thread of rank 0): each island pushes its delta when
                     its own round ends and pulls the global model, no barrier but the job's end; the server steps
                     with its default rule, islands' DiLoCo outer step spread over the pushes (plain SGD, lr 1/sqrt(M)
                     per push: DiLoCo moves lr sqrt(M) on the mean of M deltas), held under its stability limit for
                     the pushes' staleness since session 30 (stale_cap; results before that ran without it);
                     max_staleness=STALENESS so that a 4x slower island's rounds are not refused (the default 4 is
                     below the 6 pushes others make during one of them)
    ps-nesterov      the same server with the delayed Nesterov step of arXiv 2401.09135 (outer=delayed-nesterov, lr
                     0.7, momentum 0.9, N = M); the default until session 28 (results/parameter-server/quick, run
                     then, names these arms ps-sgd and ps)
    ps-wait          ps whose windows take every island (quorum = M) and wait for them up to WAIT_SHARE of a round
                     (wait=): equal islands then train as synchronous DiLoCo, a slower island is waited for no longer
                     (session 36: (a) on the byte LM, ps 1.30x DiLoCo's time to target, ps-wait 1.02x)
    ps-auto          ps-wait with wait=auto (ps_wait.PacedWait): the server learns each island's turnaround and
                     waits only for the islands due soon, no seconds to choose (session 37)
    ps-ahead         (c) only: ps whose restarted island starts at the furthest step any island acknowledged
                     (rejoin=ahead), where plain ps restarts its shard at its own last acknowledged step
    ps-auto-int8     (d) only: ps-auto with int8 pushes and int8 pulls (compressor=, pulls=: issue #36 item 1), the
                     server answering each island with the compressed gap to the copy it holds (ps_pulls)
Settings:
    (a) equal     2 islands on a 100 Mbit/s testbed link
    (b) slow      3 islands on gloo loopback, island 1 2x and island 2 4x slower (world.slowdown; every step padded
                  to a floor above its real compute time, as heterogeneous does: on a shared 2-core host a process
                  that never sleeps gets less CPU than one that sleeps)
    (c) churn     3 islands of an elastic job on gloo loopback; island 2 SIGKILLed every CHURN_EVERY of its rounds
                  and restarted by the launcher (elastic.max_restarts); the ps arms run with their server as a
                  process of its own (servers=1: thread mode is refused in elastic jobs), which outlives the kills;
                  a restarted island pulls the global model from it and starts at its last acknowledged step
    (c') churn-freeze  the same, island 2 SIGSTOPped instead (a preempted or unplugged host: no connection closes,
                  its peers learn of it only when its heartbeat is heartbeat_timeout old; the launcher then kills
                  and restarts it; session 38)
    (d) link20    2 islands on a 20 Mbit/s testbed link
    (d') link5    the same at 5 Mbit/s: run only when named (scripts/ps_settings_quick.py --settings link5)
Target: DDP's final val loss (one island of 2 workers on loopback, half the arms' step budget: LONGER). Time to target:
rank 0's training seconds (evaluation excluded, waiting at exchanges included) at the first evaluation at or under it.
Loss at equal wall time: each arm's last evaluation at or before the earliest end among its setting's arms. Goodput: the
share of computed samples that reach the global model: 1 for the synchronous arms without faults (every round is
averaged); the server's accepted samples over all pushed ones for ps (its counts, from the run record's server report);
under churn, 1 - the killed incarnations' uncommitted steps (those past their last logged round boundary: for ps, its
last acknowledged push; churn_goodput) over all steps computed, for ps times the survivors' accepted pushes over all
they pushed. Bytes: every rank's sent + received bytes (ledger), mean per worker. Server CPU and memory: measured where
the server ran, from run.json's `parameter_server` report (docs/parameter-server.md, "What the servers report"): the
thread mode's loop thread CPU (time.thread_time) and its state's tensors (global model, outer optimizer state, open
window at its largest); a server process's own CPU and peak RSS. Only a run without that report falls back to the
estimate (labelled in `server_source`): the state in the final checkpoint, and the bench process replaying the run's
pushes through the server's state on one thread; an elastic ps job keeps no checkpoint (the server's journals are its
state), so without a report its columns stay empty.

Item 5 (`target` rows): the utilisation setting (the byte LM, 2 islands of 1 worker, global batch 32, H as
utilisation's) run to a target: fp32 DiLoCo's final loss after utilisation's step budget on loopback; fp32 DiLoCo,
eager + topkq + deadline (utilisation's arm), ps, ps-int8 (int8 pushes and pulls), ps-nesterov and streaming DiLoCo
with its own 4-bit fragments (fragments=4, tau=2) each get TARGET_LONGER times that budget on loopback, 20 Mbit/s
and 5 Mbit/s testbed links; per link, each arm's time to the target against the same arm on loopback and against
fp32 DiLoCo's own loopback time (goals: the best at 20 Mbit/s <= 1.1x, at 5 Mbit/s <= 1.25x).
Quick: the digits MLP for (a)-(d) (DDP 200 steps, arms 400 at H=20, steps padded to 30 ms), the byte LM (60 steps,
H=20, as utilisation's quick tier) for item 5; full: the byte LM throughout, (a)-(d) at DDP 150 steps and arms 300 at
H=25 padded to 400 ms (the size sessions 32-41 measured each setting at), with the arms FULL_ARMS (item 5: utilisation's
full setting, FULL_TARGET_ARMS).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from islands_bench.experiments.utilisation import COMPRESSOR
from islands_bench.harness import SMOKE_LM, BenchContext, experiment
from islands_bench.plots import figure

LONGER = 2  # the arms' step budget over DDP's (heterogeneous's): room to reach DDP's loss
TARGET_LONGER = 3  # item 5: compressed arms end 4 rounds 22-66% above fp32 (utilisation): room to catch up
STALENESS = 8  # > the 4 + 2 pushes the other islands make during one round of the 4x slower island
WAIT_SHARE = 0.1  # ps-wait: a window waits up to this share of the fastest island's round (H x floor) for the rest
SLOW = {1: 2.0, 2: 4.0}  # (b): island -> how many times slower
CHURN_EVERY = 3  # (c): rounds an island trains between its restart and its next kill
VICTIM = 2  # (c): the island killed (never island 0, whose leader writes the run record)
GOALS = {"20mbit": 1.1, "5mbit": 1.25}  # item 5: best time to target over fp32 DiLoCo's on loopback
BATCH = 48  # divisible by 2 and 3 workers: the same global batch in every setting


def tier(ctx: BenchContext) -> dict:
    """The shared config of (a)-(d): task, DDP's steps, H and the step floor."""
    if ctx.smoke:  # two rounds of H=4 per arm, the digits MLP
        return dict(task="digits", ddp_steps=4, h=4, floor=0.02, log_every=4, model={})
    if ctx.quick:
        return dict(task="digits", ddp_steps=200, h=20, floor=0.03, log_every=20, model={})
    # the byte LM at the size every byte-LM setting was measured at in sessions 32-41 (scripts/ps_tier.py): its step
    # fits under the 400 ms floor on one thread; DDP 1000 steps at H=100 would take about 4.5 h of this host's CPU
    return dict(task="lm", ddp_steps=150, h=25, floor=0.4, log_every=25, model={})


# The full tier's arms (hours of CPU here): the ones that answer the question. ps-nesterov never reached DDP's loss in
# a quick tier (results/parameter-server/quick-s27, quick) and ps-wait's fixed wait is what wait=auto learns by itself
# (session 37); both stay in the quick tier
FULL_ARMS = ("diloco", "diloco-deadline", "ps", "ps-auto", "ps-auto-int8")
# item 5: eager+topkq+deadline and ps-nesterov never reached its target
FULL_TARGET_ARMS = ("diloco", "ps", "ps-int8", "streaming")


def ps_nesterov(h: int) -> str:
    """The parameter server with 2401.09135's delayed Nesterov step (its default before session 28)."""
    return f"ps:inner_steps={h},max_staleness={STALENESS},outer=delayed-nesterov"


def ps_wait(h: int, islands: int, floor: float) -> str:
    """The parameter server whose windows wait for every island up to WAIT_SHARE of a round of the fastest's."""
    return f"ps:inner_steps={h},max_staleness={STALENESS},quorum={islands},wait={WAIT_SHARE * h * floor:g}"


def arms(h: int, islands: int, floor: float) -> list[tuple[str, str]]:
    return [
        ("diloco", f"diloco:inner_steps={h}"),
        ("diloco-deadline", f"diloco:inner_steps={h},adapt=deadline"),
        ("ps", f"ps:inner_steps={h},max_staleness={STALENESS}"),
        ("ps-nesterov", ps_nesterov(h)),
        ("ps-wait", ps_wait(h, islands, floor)),
        ("ps-auto", f"ps:inner_steps={h},max_staleness={STALENESS},quorum={islands},wait=auto"),
    ]


def link_arms(h: int, islands: int) -> list[tuple[str, str]]:
    """The arms of the slow-link settings alone: ps-auto compressed both ways (issue #36 item 1)."""
    auto = f"ps:inner_steps={h},max_staleness={STALENESS},quorum={islands},wait=auto"
    return [("ps-auto-int8", f"{auto},compressor=(int8),pulls=(int8)")]


PS_ARMS = ("ps", "ps-nesterov", "ps-wait", "ps-auto", "ps-ahead", "ps-auto-int8")


def served_arm(arm: str) -> bool:
    """Whether an arm runs the parameter server: every PS_ARMS name, and an extra arm named ps... (the scripts')."""
    return arm.startswith("ps")


def churn_arms(h: int, islands: int, floor: float) -> list[tuple[str, str]]:
    """(c)'s arms: the others', and ps whose restarted island starts at the furthest acknowledged step
    (rejoin=ahead: it skips what its predecessor missed, as DiLoCo's rejoiner skips to the members' step)."""
    return arms(h, islands, floor) + [("ps-ahead", f"ps:inner_steps={h},max_staleness={STALENESS},rejoin=ahead")]


def settings(ctx: BenchContext, floor: float | None = None) -> list[tuple[str, int, str, str | None]]:
    """(name, islands, slowdown, testbed link) of (a), (b) and (d), every step padded to `floor` seconds (default:
    the tier's); the smoke tier runs (b) alone, on 2 islands."""
    floor = tier(ctx)["floor"] if floor is None else floor
    slow = ",".join(f"{i}={f}" for i, f in SLOW.items()) + f",floor={floor}"
    if ctx.smoke:
        return [("slow", 2, f"1=2.0,floor={floor}", None)]
    return [
        ("equal", 2, f"floor={floor}", "100mbit"),
        ("slow", 3, slow, None),
        ("link20", 2, f"floor={floor}", "20mbit"),
    ]


LINK_SETTINGS = ("link20", "link5")  # where link_arms run
NAMED_SETTINGS = {"link5": (2, "5mbit")}  # (islands, testbed link) of the settings run only when named (`where`)


# ---- what a run's record says -----------------------------------------------------------------------------------


def time_to(series: list[dict], target: float) -> float | None:
    """Training seconds at the first evaluation at or under `target` (None: never reached)."""
    for point in series:
        if point["val_loss"] <= target:
            return float(point["elapsed"])
    return None


def steps_to(series: list[dict], target: float) -> int | None:
    """The step of the first evaluation at or under `target`: the load-free measure beside the seconds (rank 0's
    steps; under ps, the global model then holds whatever the other islands had pushed)."""
    for point in series:
        if point["val_loss"] <= target:
            return int(point["step"])
    return None


def blocked_at(run_dir: Path, step: int) -> float:
    """Seconds the slowest-blocked rank had spent inside the outer strategy by `step` (time/blocked_s in each rank's
    live log, the last entry at or before it): the link's share of the time to target (for ps, the ranks that push
    over the link, not the server's host)."""
    worst = 0.0
    for path in sorted((run_dir / "live").glob("*.jsonl")):
        got = 0.0
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            blocked = entry.get("metrics", {}).get("time/blocked_s")
            if blocked is not None and isinstance(entry.get("step"), int) and entry["step"] <= step:
                got = float(blocked)
        worst = max(worst, got)
    return worst


def normalised_seconds(steps: int | None, per_step: float, blocked: float) -> float | None:
    """Time to target at one common compute speed: steps x `per_step` (fp32 DiLoCo's compute seconds per step on
    loopback) + the arm's own blocked seconds; on a shared host whose load moves between runs, this compares the
    numerics (steps) and the link (blocking) without the load."""
    return None if steps is None else steps * per_step + blocked


def loss_at(series: list[dict], seconds: float) -> float | None:
    """The last evaluated loss at or before `seconds` of training."""
    before = [p for p in series if p["elapsed"] <= seconds + 1e-9]
    return float(before[-1]["val_loss"]) if before else None


def mb_per_worker(rec: dict) -> float:
    """Sent + received bytes of every rank (its ledger), mean per worker, in MB: a push and its pull both cross."""
    ranks = rec["comm"]["per_rank"]
    return sum(r["total_sent"] + r["total_received"] for r in ranks) / len(ranks) / 1e6


def _find(tree, key: str):
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for v in tree.values():
            found = _find(v, key)
            if found is not None:
                return found
    return None


def server_from_checkpoint(ckpt_dir: Path) -> dict:
    """The server's counts and state bytes from the newest checkpoint's rank-0 manifest (the host of the server)."""
    steps = sorted(p for p in ckpt_dir.glob("step-*") if p.is_dir())
    if not steps:
        raise RuntimeError(f"no checkpoint under {ckpt_dir}: the ps arm needs its final one for the server's counts")
    body = json.loads((steps[-1] / "rank00000.manifest.json").read_text())["body"]  # islands-checkpoint/1
    state = _find(body["skeleton"], "ps_server")
    if state is None:
        raise RuntimeError(f"{steps[-1]} holds no ps_server state")
    nbytes = 0
    for name, entry in body["tensors"].items():
        if "/ps_server/" in name:
            numel = 1
            for n in entry["shape"]:
                numel *= int(n)
            nbytes += numel * {"float32": 4, "float64": 8, "int64": 8, "bfloat16": 2, "float16": 2}[entry["dtype"]]
    counts = state["counts"]
    total = counts["samples"] + counts["samples_refused"]
    return {
        "pushes": int(counts["pushes"]),
        "refused": int(counts["refused"]),
        "outer_steps": int(counts["steps"]),
        "goodput": counts["samples"] / total if total else 1.0,
        "server_mb": nbytes / 1e6,
    }


def server_cpu_seconds(numel: int, pushes: int, islands: int) -> float:
    """CPU seconds on one thread for the server's arithmetic of `pushes` pushes at quorum 1 (ps_server.ServerState's
    order): a window of one push merged by its weight, the ps arm's outer step (delayed Nesterov 0.7/0.9, buffer =
    islands) and the pull's copy of the global model; replayed here with the public DelayedNesterov."""
    import torch

    from islands.outer import DelayedNesterov

    rule, params = DelayedNesterov(0.7, 0.9, islands), torch.zeros(numel)
    delta = torch.randn(numel) * 1e-3
    t = time.thread_time()
    for _ in range(pushes):
        merged = torch.zeros(numel)
        merged.add_(delta, alpha=1.0).div_(1.0)
        rule.step(params, merged, 0, numel, lr_scale=1.0)
        torch.cat([params])
    return time.thread_time() - t


# ---- (a), (b), (d) ---------------------------------------------------------------------------------------------


def _arm_row(ctx, setting, arm, rec, target, numel, load, checkpointed: bool = True) -> dict:
    """One arm's row; `checkpointed`: a ps arm without a server report may be estimated from its final checkpoint
    (not in an elastic job, which keeps none)."""
    s = rec["summary"]
    row = {
        "setting": setting,
        "run": arm,
        "time_to_target_s": time_to(rec["series"]["val"], target),
        "steps_to_target": steps_to(rec["series"]["val"], target),
        "final_val_loss": s["final_val_loss"],
        "wall_s": s["wall_seconds"],
        "goodput": 1.0,
        "mb_per_worker": mb_per_worker(rec),
        "server_cpu_s": None,
        "server_mb": None,
        "server_memory": None,
        "refused": None,
        "server_restarts": None,
        "server_source": None,
        "load": load,
        "interconnect": rec["interconnect_line"],
    }
    if served_arm(arm) and (checkpointed or measured_server(rec) is not None):
        row.update(server_columns(rec, numel))
    return row


def measured_server(rec: dict) -> dict | None:
    """The server columns from run.json's `parameter_server` report (None: the run has none, or no CPU in it)."""
    report = rec.get("parameter_server")
    if not report or not report["servers"] or report["cpu_seconds"] is None:
        return None
    first = report["servers"][0]  # every server sees every push (its own range of it): one server's counts
    return {
        "goodput": first["goodput"],
        "server_cpu_s": report["cpu_seconds"],
        "server_mb": sum(server["peak_memory_bytes"] for server in report["servers"]) / 1e6,
        "server_memory": first["peak_memory"],
        "refused": first["pushes_refused"],
        "server_restarts": report["restarts"],
        "server_source": f"measured ({report['mode']} mode" + ("" if report["complete"] else ", incomplete") + ")",
    }


def server_columns(rec: dict, numel: int) -> dict:
    """The ps arm's server columns: measured, from the run record's report of what the servers did (run.json
    `parameter_server`: the loop thread's CPU and state bytes, or each server process's CPU and peak RSS); only
    where a run has none, the estimate from its final checkpoint (counts, state bytes) and a replay of its pushes
    in this process, labelled so (`server_source`)."""
    measured = measured_server(rec)
    if measured is not None:
        return measured
    server = server_from_checkpoint(Path(rec["run_dir"]) / "ckpt")
    missing = (rec.get("parameter_server") or {}).get("missing") or "the run record has no parameter_server report"
    return {
        "goodput": server["goodput"],
        "server_cpu_s": server_cpu_seconds(numel, server["pushes"], rec["summary"]["islands"]),
        "server_mb": server["server_mb"],
        "server_memory": "state_tensors",
        "refused": server["refused"],
        "server_restarts": None,
        "server_source": f"estimate (replayed pushes, checkpoint state): {missing}",
    }


def _ps_extra(arm: str, run_dir: Path, steps: int) -> dict:
    """The ps arm keeps a final checkpoint: the server's counts and state, for the estimate where a run's record has
    no server report (server_columns)."""
    return {"checkpoint.dir": str(run_dir / "ckpt"), "checkpoint.every": steps} if served_arm(arm) else {}


def run_settings(
    ctx: BenchContext,
    t: dict,
    target: float,
    numel: int,
    only: tuple[str, ...] | None = None,
    extra: tuple[tuple[str, str], ...] = (),
    where: tuple[str, ...] | None = None,
    tag: str = "",
) -> list[dict]:
    """(a), (b), (d): every arm in every setting. `only`: the arms to run (None: all); `extra`: (name, spec) arms
    beside them (a name starting with ps is a ps arm); `where`: the settings to run (None: all); `tag`: appended to
    each run's label (repeated runs in one output folder)."""
    h, steps = t["h"], LONGER * t["ddp_steps"]
    base = dict(task=t["task"], steps=steps, global_batch=BATCH, warmup=max(steps // 10, 1), eval_every=h)
    base.update(log_every=t["log_every"], **t["model"])
    rows = []
    asked = where or ()
    named = [(name, n, f"floor={t['floor']}", link) for name, (n, link) in NAMED_SETTINGS.items() if name in asked]
    for setting, islands, slowdown, link in settings(ctx, t["floor"]) + named:
        if where is not None and setting not in where:
            continue
        bed = ctx.testbed(link, hosts=islands) if link else None
        with bed if bed is not None else _nothing() as b:
            kw = {"testbed": b.name} if b is not None else {}
            slow_link = link_arms(h, islands) if setting in LINK_SETTINGS else []
            for arm, spec in arms(h, islands, t["floor"]) + slow_link + list(extra):
                if only is not None and arm not in only:
                    continue
                if ctx.smoke and arm in (
                    "diloco-deadline",
                    "ps-nesterov",
                    "ps-wait",
                    "ps-auto",
                ):  # smoke: one arm of each kind (deadline is a diloco spec; wait a ps spec)
                    continue
                label = f"{arm}@{setting}{tag}"
                load0 = os.getloadavg()[0]
                run_dir = ctx.out_dir / "runs" / label
                over = dict(base, workers=islands, islands=islands, outer=spec, slowdown=slowdown, **kw)
                rec = ctx.train(label, **over, **_ps_extra(arm, run_dir, steps))
                rows.append(_arm_row(ctx, setting, arm, rec, target, numel, max(load0, os.getloadavg()[0])))
                rows[-1]["_series"] = rec["series"]["val"]
    return rows


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ---- (c) churn ---------------------------------------------------------------------------------------------------


class GroupRounds:
    """Rounds the group has begun, from the job's store: round/<r>/join (the members begin round r's exchange)."""

    def __init__(self):
        self.seen = 0

    def __call__(self, store) -> int:
        while store.check([f"round/{self.seen + 1}/join"]):
            self.seen += 1
        return self.seen


class ServedRounds:
    """Under ps (no group rounds): the rounds island VICTIM's data shard has pushed, from the job's store (ps/clock/
    <shard>: the step of its last acknowledged push, continued by each restart; islands.sync.outer.ps_elastic)."""

    def __init__(self, h: int):
        self.h = h

    def __call__(self, store) -> int:
        key = f"ps/clock/{VICTIM}"
        return json.loads(store.get(key))["step"] // self.h if store.check([key]) else 0


FAULTS = ("kill", "freeze")  # (c)'s outage: a process that dies, or a host that vanishes without closing a socket


def _killer(
    address: str,
    workers: list,
    run_dir: Path,
    every: int,
    log: dict,
    stop: threading.Event,
    rounds=None,
    fault: str = "kill",
    heartbeat_timeout: float = 3.0,
) -> None:
    """Take island VICTIM's live incarnation out once it has trained through `every` rounds (the launcher restarts
    it; `workers` grows with the restarts): a fault before a restarted island trains again would only repeat one
    outage. `rounds(store)`: the rounds begun so far (GroupRounds, the default, or ServedRounds under ps).
    `fault`: "kill" sends SIGKILL (the kernel closes its connections: peers learn at once); "freeze" sends SIGSTOP,
    a preempted or unplugged host whose peers hear nothing (its heartbeat stops; the launcher kills and restarts it
    after `heartbeat_timeout`), with a SIGKILL of our own 3 timeouts later should nothing have."""
    from islands.control import observe_job

    store = observe_job(address, log["token"])
    rounds = rounds if rounds is not None else GroupRounds()
    kill_at: int | None = every  # the round at which to kill (None: wait until a restarted incarnation trains)
    while not stop.is_set():
        try:
            seen = rounds(store)
        except (RuntimeError, OSError):  # the job ended and its store with it (DistNetworkError is a RuntimeError)
            return
        live = [w for w in workers if getattr(w, "island", None) == VICTIM and w.proc.poll() is None]
        trains = bool(live) and '"step"' in _read(run_dir / "live" / f"{getattr(live[-1], 'name', '')}.jsonl")
        if kill_at is None and trains:
            kill_at = seen + every
        elif kill_at is not None and trains and seen >= kill_at:
            victim = live[-1].proc
            victim.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            log["kills"].append(
                {"round": seen, "name": getattr(live[-1], "name", "?"), "time": time.time(), "fault": fault}
            )
            kill_at = None
            if fault == "freeze":
                _backstop(victim, 3 * heartbeat_timeout, stop)
        time.sleep(0.02)


def _backstop(proc, after: float, stop: threading.Event) -> None:
    """Wait for a frozen victim to be killed by the launcher (its heartbeat timeout); SIGKILL it ourselves after
    `after` seconds so that a missed detection shows as a slow arm, not a hung bench."""
    deadline = time.monotonic() + after
    while proc.poll() is None and time.monotonic() < deadline and not stop.is_set():
        time.sleep(0.02)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def run_churn(
    ctx: BenchContext,
    t: dict,
    target: float,
    numel: int,
    only: tuple[str, ...] | None = None,
    tag: str = "",
    every: int = CHURN_EVERY,
    extra: tuple[tuple[str, str], ...] = (),
    fault: str = "kill",
) -> tuple[list[dict], dict[str, str]]:
    """(c): the arms of an elastic job with island 2 killed every CHURN_EVERY rounds, each that islands runs
    elastic (the ps arms with servers=1). Returns the rows and, per arm not run, why (islands' refusal). `only`: the
    arms to run (None: all); `tag`: appended to each run's label (repeated runs in one output folder); `every`: rounds
    between kills (0: none, the same elastic job without churn, a control); `extra`: (name, spec) arms to run beside
    them (a name starting with ps runs as a ps arm, servers=1); `fault`: one of FAULTS (_killer)."""
    if fault not in FAULTS:
        raise ValueError(f"fault={fault!r}: expected one of {', '.join(FAULTS)}")
    setting = "churn" if fault == "kill" else f"churn-{fault}"  # the rows' setting: (c), or (c') churn-freeze
    h, steps = t["h"], LONGER * t["ddp_steps"]
    if ctx.smoke:
        steps = ctx.smoke_steps
    base = dict(
        task=t["task"],
        workers=3,
        islands=3,
        elastic=True,
        steps=steps,
        global_batch=BATCH,
        warmup=max(steps // 10, 1),
        eval_every=h,
        log_every=1,  # every step in the live logs: where each incarnation stopped (churn_goodput)
        slowdown=f"floor={t['floor']}",
        max_restarts=steps // (CHURN_EVERY * h) + 2,
        heartbeat_timeout=3.0,
        timeout=60.0,
        probe=False,
        **t["model"],
    )
    rows, not_run = [], {}
    for arm, spec in churn_arms(h, base["islands"], t["floor"]) + list(extra):
        if only is not None and arm not in only:
            continue
        served = served_arm(arm)
        spec = f"{spec},servers=1" if served else spec  # thread mode is refused in elastic jobs
        why = _refused(ctx, dict(base, outer=spec))
        if why:
            not_run[arm] = why
            continue
        label = f"{arm}@{setting}{tag}"
        log: dict = {"kills": []}
        stop = threading.Event()
        run_dir = ctx.out_dir / "runs" / label

        def started(address, workers, coordinator, log=log, stop=stop, run_dir=run_dir, served=served):
            log["token"] = os.environ["ISLANDS_TOKEN"]
            rounds = ServedRounds(h) if served else None
            args = (address, workers, run_dir, every, log, stop, rounds, fault, base["heartbeat_timeout"])
            if every:
                threading.Thread(target=_killer, args=args, daemon=True).start()

        load0 = os.getloadavg()[0]
        try:
            rec = ctx.train_elastic(label, on_started=started, outer=spec, **base)
        finally:
            stop.set()
        row = _arm_row(ctx, setting, arm, rec, target, numel, max(load0, os.getloadavg()[0]), checkpointed=False)
        row["goodput"] = churn_goodput(run_dir, h)
        row["kills"] = len(log["kills"])
        row["fault"] = fault
        row["_kill_log"] = log["kills"]  # round and wall time of each SIGKILL (scripts/ps_churn_quick.py's timeline)
        row["_run_dir"] = str(run_dir)  # where the script's timeline reads the run
        if served:
            pushes, refused = served_counts(run_dir)
            row.update(refused=refused, goodput=row["goodput"] * pushes / max(pushes + refused, 1))
        # the launcher's own record of the island's restarts: one per kill (nothing else stops it)
        restarts = run_dir / "elastic" / "restarts.json"  # written at the first restart (none without kills)
        row["restarts"] = len(json.loads(restarts.read_text())["restarts"]) if restarts.is_file() else 0
        row["_series"] = rec["series"]["val"]
        rows.append(row)
    return rows, not_run


def _refused(ctx: BenchContext, overrides: dict) -> str | None:
    """Why islands refuses this elastic config (validate's message), or None."""
    from islands.config import ConfigError

    try:
        ctx.config(**overrides)
    except ConfigError as e:
        return str(e).strip().splitlines()[-1]
    return None


def served_counts(run_dir: Path) -> tuple[int, int]:
    """An elastic ps job's surviving islands' pushes the server applied and refused (their served_end events in
    RUN_DIR/elastic/NAME.json; killed incarnations write none)."""
    pushes = refused = 0
    for path in sorted((run_dir / "elastic").glob("*.json")):
        if path.stem == "restarts":
            continue
        for event in json.loads(path.read_text())["final"]["events"]:
            if event["type"] == "served_end":
                pushes, refused = pushes + int(event["pushes"]), refused + int(event["refused"])
    return pushes, refused


def churn_goodput(run_dir: Path, h: int) -> float:
    """1 - lost / computed steps, from every incarnation's live log (logged every step): an incarnation that ended
    before the job's last step (killed) lost its steps since the last round boundary it logged. A logged step comes
    after the strategy's after_step (Trainer: after_step, then the callbacks), so a logged boundary step's push (ps:
    acknowledged before after_step returns) or exchange (DiLoCo) is done: nothing of that round is lost. Until
    session 30 a kill at a boundary counted the whole round lost, which under ps is exactly where the churn kills
    (just after an acknowledged push, as its restart's step shows) and put its goodput at 90% where it lost ~1%.
    Computed steps: each incarnation's last logged step minus where it started (its first logged step, or the step
    before it when that is not a round boundary: a restarted island logs its entry step's next step first)."""
    span: dict[str, tuple[int, int]] = {}  # name -> (first step, last step) logged
    for path in sorted((run_dir / "live").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            step = json.loads(line).get("step")
            if isinstance(step, int):
                first, _ = span.get(path.stem, (step, step))
                span[path.stem] = (min(first, step), step)
    if not span:
        raise RuntimeError(f"{run_dir / 'live'} holds no logged steps")
    end = max(last for _, last in span.values())
    computed = sum(last - (first if first % h == 0 else first - 1) for first, last in span.values())
    lost = sum(last - h * (last // h) for first, last in span.values() if last < end and last > first)
    return 1.0 - lost / computed if computed else float("nan")


# ---- item 5: the utilisation setting to a target loss -------------------------------------------------------------


def target_arms(h: int) -> list[tuple[str, str]]:
    return [
        ("diloco", f"diloco:inner_steps={h}"),
        ("eager+topkq+deadline", f"diloco:inner_steps={h},overlap=eager,compressor=({COMPRESSOR}),adapt=deadline"),
        ("ps", f"ps:inner_steps={h},max_staleness={STALENESS}"),
        # int8 both ways: pushes with error feedback, answers as steps from each island's copy (issue #36 item 1)
        ("ps-int8", f"ps:inner_steps={h},max_staleness={STALENESS},compressor=(int8),pulls=(int8)"),
        ("ps-nesterov", ps_nesterov(h)),
        # streaming DiLoCo as designed (SOTA-155, arXiv 2501.18512): 4 fragments at staggered rounds, each sent in its
        # own 4-bit codec and landed tau=2 steps later, so an exchange is 1/32 of fp32 DiLoCo's round and overlapped
        ("streaming", f"streaming-diloco:inner_steps={h},fragments=4,tau=2"),
    ]


def run_targets(ctx: BenchContext, only: tuple[str, ...] | None = None) -> tuple[list[dict], float]:
    """Item 5's rows and its target; `only`: the arms to run (None: the tier's; diloco always, the baseline)."""
    steps, h = (60, 20) if ctx.quick else (200, 50)  # utilisation's quick and full settings
    links: tuple[str, ...] = ("20mbit", "5mbit")
    model: dict = {}
    if ctx.smoke:  # one link, two rounds of H=4 on a tiny LM, the reference and ps alone
        steps, h, links, model = 8, 4, (), SMOKE_LM
    base = dict(task="lm", global_batch=32, workers=2, islands=2, eval_every=h, log_every=h, **model)
    longer = ctx.smoke_steps if ctx.smoke else TARGET_LONGER * steps
    run = dict(base, steps=longer, warmup=max(steps // 10, 1))
    target = None
    if not ctx.smoke:  # the smoke tier's target is its one arm's own final loss (its numbers mean nothing)
        ref = dict(base, steps=steps, warmup=max(steps // 10, 1), eval_every=0)
        target = ctx.train("target-ref@loopback", outer=f"diloco:inner_steps={h}", **ref)["summary"]["final_val_loss"]
    plan = target_arms(h)[2:3] if ctx.smoke else target_arms(h)
    if not ctx.quick:
        plan = [(arm, spec) for arm, spec in plan if arm in FULL_TARGET_ARMS]
    if only is not None:
        plan = [(arm, spec) for arm, spec in plan if arm in only or arm == "diloco"]
    recs = {}
    rows = []
    for link in ("loopback", *links):
        bed = ctx.testbed(link, hosts=2) if link != "loopback" else None
        with bed if bed is not None else _nothing() as b:
            kw = {"testbed": b.name} if b is not None else {}
            for arm, spec in plan:
                label = f"target-{arm}@{link}"
                load0 = os.getloadavg()[0]
                rec = recs[(arm, link)] = ctx.train(label, outer=spec, **run, **kw)
                rows.append(
                    {
                        "setting": "target",
                        "run": arm,
                        "link": link,
                        "time_to_target_s": None,
                        "final_val_loss": rec["summary"]["final_val_loss"],
                        "wall_s": rec["summary"]["wall_seconds"],
                        "mb_per_worker": mb_per_worker(rec),
                        "load": max(load0, os.getloadavg()[0]),
                        "interconnect": rec["interconnect_line"],
                        **((measured_server(rec) or {}) if served_arm(arm) else {}),
                    }
                )
    if target is None:
        target = min(r["final_val_loss"] for r in rows)
    for r in rows:
        r["time_to_target_s"] = time_to(recs[(r["run"], r["link"])]["series"]["val"], target)
        r["steps_to_target"] = steps_to(recs[(r["run"], r["link"])]["series"]["val"], target)
    ref_rec = recs.get(("diloco", "loopback"), recs[plan[0][0], "loopback"])
    ref_s = ref_rec["summary"]
    per_step = (ref_s["wall_seconds"] - ref_s["sync_blocked_seconds"]) / ref_s["steps"]  # rank 0's compute
    for r in rows:
        rec = recs[(r["run"], r["link"])]
        steps_ = r["steps_to_target"]
        r["blocked_to_target_s"] = blocked_at(Path(rec["run_dir"]), steps_) if steps_ is not None else None
        r["normalised_s"] = normalised_seconds(steps_, per_step, r["blocked_to_target_s"] or 0.0)
    by = {(r["run"], r["link"]): r for r in rows}
    base_t = by.get(("diloco", "loopback"), {}).get("time_to_target_s")
    base_n = by.get(("diloco", "loopback"), {}).get("normalised_s")
    for r in rows:
        own, own_n = by[(r["run"], "loopback")]["time_to_target_s"], by[(r["run"], "loopback")]["normalised_s"]
        t, n = r["time_to_target_s"], r["normalised_s"]
        r["vs_own_loopback"] = t / own if t and own else None
        r["vs_diloco_loopback"] = t / base_t if t and base_t else None
        r["normalised_vs_own_loopback"] = n / own_n if n and own_n else None
        r["normalised_vs_diloco_loopback"] = n / base_n if n and base_n else None
    return rows, target


def goal_text(rows: list[dict], setting: str, arm: str) -> str:
    """Issue #36's goal for one ps arm in one setting: (b), (c) at least 1.5x sooner than synchronous DiLoCo and
    sooner than deadline rounds with goodput >= 90%; (a) within 5% of synchronous DiLoCo's time."""
    here = {r["run"]: r for r in rows if r["setting"] == setting}
    ps, sync, dl = here.get(arm), here.get("diloco"), here.get("diloco-deadline")
    goal = (
        f"{arm} within 5% of diloco's time"
        if setting == "equal"
        else f"{arm} >= 1.5x sooner than diloco, sooner than deadline rounds, goodput >= 90%"
    )
    if ps is None or "note" in ps:
        return f"({setting}) goal {goal}: not measured ({arm} not run)"
    t, t_sync = ps["time_to_target_s"], sync["time_to_target_s"] if sync else None
    if t is None:
        return f"({setting}) goal {goal}: not met ({arm} never reached the target)"
    if t_sync is None:
        return f"({setting}) goal {goal}: not measured (diloco never reached the target)"
    if setting == "equal":
        return f"({setting}) goal {goal}: {t / t_sync:.2f}x, {'met' if t <= 1.05 * t_sync else 'not met'}"
    t_dl = dl["time_to_target_s"] if dl and "note" not in dl else None
    met = t_sync / t >= 1.5 and (t_dl is None or t < t_dl) and ps["goodput"] >= 0.9
    vs_dl = f"deadline {t_dl:.1f} s" if t_dl is not None else "deadline not reached or not run"
    return (
        f"({setting}) goal {goal}: {t_sync / t:.2f}x sooner, {vs_dl}, goodput {100 * ps['goodput']:.1f}%: "
        f"{'met' if met else 'not met'}"
    )


def item5_text(rows: list[dict], link: str, goal: float, target: float) -> str:
    """Item 5's line for one link: each arm's seconds and steps to the target against its own loopback run and fp32
    DiLoCo's, measured and at one common compute speed (normalised_seconds), and whether the best meets `goal`."""
    here = [r for r in rows if r["link"] == link]
    if not here:
        return f"item 5, {link}: not run"

    def one(r: dict) -> str:
        if not r["time_to_target_s"]:
            return f"{r['run']} not reached (final {r['final_val_loss']:.4f})"
        return (
            f"{r['run']} {r['time_to_target_s']:.1f} s at step {r['steps_to_target']} (x{r['vs_own_loopback']:.2f} "
            f"its loopback, x{r['vs_diloco_loopback']:.2f} fp32 DiLoCo's loopback; normalised "
            f"x{r['normalised_vs_diloco_loopback']:.2f}, blocked {r['blocked_to_target_s']:.1f} s)"
        )

    def best(key: str) -> str:
        got = [r for r in here if r[key] is not None]
        if not got:
            return "none reached it"
        b = min(got, key=lambda r: r[key])
        return f"{b['run']} x{b[key]:.2f}: {'met' if b[key] <= goal else 'not met'}"

    return (
        f"item 5, testbed {link}, target fp32 DiLoCo's loopback loss {target:.4f} (byte LM): "
        + "; ".join(one(r) for r in here)
        + f"; goal best <= {goal}x fp32 DiLoCo's loopback time: measured {best('vs_diloco_loopback')}, "
        f"normalised {best('normalised_vs_diloco_loopback')}"
    )


def server_text(rows: list[dict]) -> str:
    """The ps arms' servers, as their runs measured them (or the estimate, where a run has no report)."""
    here = [r for r in rows if r.get("server_source")]
    if not here:
        return "server: no ps arm ran"
    return (
        "server (CPU seconds, peak memory: "
        + MEMORY_WORDS
        + "): "
        + "; ".join(
            f"{r['run']}@{r.get('link', r['setting'])} {r['server_cpu_s']:.3f} CPU-s, {r['server_mb']:.2f} MB "
            f"{r['server_memory']}, refused {r['refused']}, goodput {100 * r['goodput']:.1f}%, {r['server_source']}"
            for r in here
        )
    )


MEMORY_WORDS = (
    "state_tensors = the server state's tensors, global model + outer optimizer state + open window at its largest; "
    "max_rss = a server process's peak resident set, torch's own included"
)


# ---- the experiment ------------------------------------------------------------------------------------------------


def _plot(result, path):
    rows = [r for r in result["rows"] if r["setting"] != "target"]
    settings_ = list(dict.fromkeys(r["setting"] for r in rows))
    with figure(path, 1, max(len(settings_), 1), figsize=(3.6 * max(len(settings_), 1), 3.6)) as (fig, ax):
        ax = ax if len(settings_) > 1 else [ax]
        for a, setting in zip(ax, settings_):
            for label, pts in result["val_series"].items():
                if label.endswith(f"@{setting}"):
                    a.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=label.split("@")[0])
            a.axhline(result["target"], color="grey", lw=0.8, ls="--")
            a.set_yscale("log")
            a.set_title(setting, fontsize=9)
            a.set_xlabel("training seconds (rank 0)")
            a.legend(fontsize=7)
        fig.suptitle(f"parameter-server{' (quick)' if result['quick'] else ''}: val loss, target dashed", fontsize=9)


def ddp_target(ctx: BenchContext, t: dict) -> float:
    """The experiment's target: DDP's final validation loss (one island of 2 workers, the tier's steps and floor)."""
    steps = t["ddp_steps"]
    rec = ctx.train(
        "ddp",
        task=t["task"],
        workers=2,
        islands=1,
        steps=steps,
        global_batch=BATCH,
        warmup=max(steps // 10, 1),
        eval_every=t["h"],
        log_every=t["log_every"],
        slowdown=f"floor={t['floor']}",
        **t["model"],
    )
    return float(rec["summary"]["final_val_loss"])


def _numel(t: dict) -> int:
    from islands_bench.experiments.outer_common import parameter_count

    return parameter_count(dict(task=t["task"], **t["model"]))


def _words(rows: list[dict], setting: str) -> str:
    here = {r["run"]: r for r in rows if r["setting"] == setting}
    if "diloco" not in here:
        return f"({setting}) not run"
    base = here["diloco"]["time_to_target_s"]

    def one(name: str) -> str:
        r = here.get(name)
        if r is None:
            return f"{name} not run"
        if "note" in r:  # an arm islands does not run in this setting yet
            return f"{name} {r['note']}"
        t = r["time_to_target_s"]
        reach = (
            (f"{t:.1f} s" + (f" ({base / t:.2f}x sooner than diloco)" if base and name != "diloco" else ""))
            if t
            else "not reached"
        )
        extra = f", goodput {100 * r['goodput']:.1f}%" if r.get("goodput") is not None else ""
        extra += (
            f", loss at equal wall {r['loss_at_equal_wall']:.4f}" if r.get("loss_at_equal_wall") is not None else ""
        )
        return f"{name} {reach}{extra}, {r['mb_per_worker']:.2f} MB/worker"

    return f"({setting}) " + "; ".join(one(n) for n in ("diloco", "diloco-deadline", *PS_ARMS))


@experiment(
    "parameter-server",
    practices=("SOTA-907", "SOTA-912", "SOTA-910", "Q-6"),
    help="synchronous DiLoCo, deadline rounds and the parameter server: time to DDP's loss on equal islands at "
    "100 Mbit/s, a 2x and a 4x slower island, churn and 20 Mbit/s; the utilisation setting to a target loss",
)
def parameter_server(ctx: BenchContext) -> dict:
    t = tier(ctx)
    if ctx.smoke:  # two rounds per arm
        ctx.smoke_steps = 2 * t["h"]
    n_settings = len(settings(ctx))
    # churn: the arms islands runs elastic, killed and frozen
    only = None if ctx.quick else FULL_ARMS
    if ctx.smoke:
        ctx.plan(1 + 2 + 1)
    elif ctx.quick:
        ctx.plan(1 + 4 * n_settings + 1 + 1 + 1 + 12 + 12 + 3)
    else:
        per_setting = len(FULL_ARMS) - 1  # ps-auto-int8 runs in (d) alone, and not under churn
        ctx.plan(1 + per_setting * n_settings + 1 + 2 * (per_setting - 1) + 1 + 3 * len(FULL_TARGET_ARMS))
    uptime = [f"start {time.strftime('%H:%M:%S')} load {os.getloadavg()}"]
    ddp_steps = t["ddp_steps"]
    target = ddp_target(ctx, t)
    numel = _numel(t)
    rows = run_settings(ctx, t, target, numel, only=only)
    churn_rows, not_run = ([], {}) if ctx.smoke else run_churn(ctx, t, target, numel, only=only)
    rows += churn_rows
    if not ctx.smoke:  # the same churn with hosts that vanish: peers learn of it only by the heartbeat timeout
        rows += run_churn(ctx, t, target, numel, only=only, fault="freeze")[0]
    target_rows, lm_target = run_targets(ctx)
    uptime.append(f"end {time.strftime('%H:%M:%S')} load {os.getloadavg()}")

    series = {f"{r['run']}@{r['setting']}": r.pop("_series") for r in rows}
    for r in rows:
        r.pop("_kill_log", None)  # the churn timeline's raw kills and run: scripts/ps_churn_quick.py reads them
        r.pop("_run_dir", None)
    for setting in dict.fromkeys(r["setting"] for r in rows):
        here = [r for r in rows if r["setting"] == setting]
        equal = min(series[f"{r['run']}@{setting}"][-1]["elapsed"] for r in here)
        base = next((r["time_to_target_s"] for r in here if r["run"] == "diloco"), None)
        for r in here:
            r["equal_wall_s"] = equal
            r["loss_at_equal_wall"] = loss_at(series[f"{r['run']}@{setting}"], equal)
            t_ = r["time_to_target_s"]
            r["speedup_vs_diloco"] = base / t_ if base and t_ else None
    for arm, why in not_run.items():
        rows.append({"setting": "churn", "run": arm, "time_to_target_s": None, "note": f"not run: {why}"})

    model = "digits MLP (quick; the byte LM runs without --quick)" if ctx.quick else "byte LM"
    headline = [
        f"time to DDP's loss {target:.4f} ({model}, global batch {BATCH}, DDP {ddp_steps} steps, arms "
        f"{LONGER * ddp_steps} steps per island at H={t['h']}, steps padded to {1000 * t['floor']:.0f} ms; rank 0's "
        f"training seconds): " + " | ".join(_words(rows, s) for s in dict.fromkeys(r["setting"] for r in rows))
    ]
    headline += [f"(c) churn: the {arm} arm is not yet supported by islands: {why}" for arm, why in not_run.items()]
    goal_words = [
        goal_text(rows, setting, arm) for setting in ("slow", "churn", "churn-freeze", "equal") for arm in PS_ARMS
    ]
    headline += goal_words
    by = {(r["run"], r["link"]): r for r in target_rows}
    headline += [item5_text(target_rows, link, goal, lm_target) for link, goal in GOALS.items()]
    loop = [r for r in target_rows if r["link"] == "loopback"]
    if loop:
        headline.append(
            "item 5 on loopback: "
            + ", ".join(
                f"{r['run']} " + (f"{r['time_to_target_s']:.1f} s" if r["time_to_target_s"] else "not reached")
                for r in loop
            )
            + f" (fp32 DiLoCo's loopback time: {by.get(('diloco', 'loopback'), {}).get('time_to_target_s')})"
        )
    headline.append(server_text(rows + target_rows))
    headline.append(
        f"shared {os.cpu_count()}-core host, load average: {'; '.join(uptime)}; every arm run once, ratios within "
        "this invocation"
    )
    return {
        "rows": rows + target_rows,
        "headline": headline,
        "plot": _plot,
        "target": target,
        "lm_target": lm_target,
        "uptime": uptime,
        "staleness": STALENESS,
        "churn_not_run": not_run,
        "val_series": {k: [(p["elapsed"], p["val_loss"]) for p in v] for k, v in series.items()},
    }
