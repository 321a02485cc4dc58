"""utilisation (issue 19 item 3): how much of the wall time the workers compute, on real slow links.

For each rate-limited testbed link (2 hosts, one island of one worker on each; network namespaces joined by a
tbf-shaped veth star, docs/testbed.md) and each arm, one training run of the default byte LM:

    utilisation     = 1 - blocked / wall       blocked: the loop's time inside the outer strategy (after_step and
                                               the final synchronisation; trainer.sync_seconds), wall: the run's
                                               training time (evaluation excluded); each worker's own (its live
                                               log), averaged over the workers; rank 0's alone is reported too
    step-time ratio = (wall / steps) on the link  /  (wall / steps) of the same arm on gloo loopback (no link):
                      what the link costs a step, blocking and contention for the CPU together

Arms: DiLoCo, streaming DiLoCo (F=4, tau=2, fp32 fragments), DiLoCo overlap=delayed ("async": each round's average
lands one round late, LIT-907) and overlap=eager (the island's own fresh delta stands in until it lands, LIT-906),
each with fp32 deltas and with the topkq compressor (10% per chunk, 2-bit values, error feedback; SOTA-902), eager
also with outer-compression's 146x payload (`eager+topkq146x`: Elias-Fano positions, SOTA-905, decay 0.95), both
eager+topkq arms also with deadline rounds (`+deadline`: adapt=deadline, each island catching up with the earliest,
SOTA-912),
plus torchft 0.2.0's DiLoCo and streaming DiLoCo (torchft.local_sgd.DiLoCo, fragment_sync_delay=2, F=4 at the quick
tier's H=20 and F=5 at the full tier's H=50: torchft needs F to divide H) on the same links, one torchft replica
group per island, with the same task, data shards, inner optimizer, schedule and outer step (plain SGD, lr sqrt(2));
utilisation_torchft_worker.py says how its blocked time is timed. torchft ends without a final synchronisation.

Every ratio is measured inside one invocation, side by side; the machine's load average is recorded with each
run because this host's 2 cores are shared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from islands_bench.experiments.outer_common import gap_pct
from islands_bench.harness import SMOKE_LM, BenchContext, experiment
from islands_bench.plots import figure

GOALS = {"20mbit": 0.99, "5mbit": 0.97}  # issue 19: utilisation at 20 and 5 Mbit/s with the default model
# topkq (SOTA-902's payload: per-chunk top-k, 2-bit values, error feedback) at 10%: the density outer-compression
# found near fp32 DiLoCo's loss (+2.3%, 23x fewer bytes per round, 30 rounds); at 1% (216x) it was +26.5%, and with
# the 3 rounds of the quick tier 1% leaves the global model near its initialisation (measured: loss 4.68 vs 2.90)
COMPRESSOR = "topkq:ratio=0.1,bits=2"
# The 146x payload of outer-compression's goal arm (Elias-Fano positions, 89 of each 4096, SparseLoCo's decay 0.95):
# 23 KB a round instead of 154 KB, so the last round's exchange, the one an overlapped run cannot hide, is ~7x
# shorter on a slow link. Run on the eager arm only: at a handful of rounds its loss is far from fp32's
# (outer-compression: it needs many rounds).
COMPRESSOR_146X = "topkq:ratio=0.0215,bits=2,index=elias-fano,decay=0.95"
STREAM = "fragments=4,tau=2,bits=32"  # the streaming setting; fp32 so the compressor axis is the only codec


def arms(h: int) -> list[tuple[str, str]]:
    return [
        ("diloco", f"diloco:inner_steps={h}"),
        ("streaming", f"streaming-diloco:inner_steps={h},{STREAM}"),
        ("async", f"diloco:inner_steps={h},overlap=delayed"),
        ("eager", f"diloco:inner_steps={h},overlap=eager"),
    ]


def with_compressor(spec: str, compressor: str | None) -> str:
    return spec if compressor is None else f"{spec},compressor=({compressor})"


def utilisation_of(blocked: float, wall: float) -> float:
    if wall <= 0 or blocked < 0 or blocked > wall * 1.001:
        raise ValueError(f"need 0 <= blocked <= wall and wall > 0; got blocked={blocked}, wall={wall}")
    return 1.0 - blocked / wall


def worker_utilisation(run_dir: Path, workers: int) -> list[float]:
    """Each worker's own 1 - blocked/elapsed, from the last time/* metrics it logged (live/rank<r>.jsonl): the run
    record's summary holds rank 0's only, and the faster island's wait for the slower one shows on one rank."""
    out = []
    for r in range(workers):
        last = None
        for line in (run_dir / "live" / f"rank{r}.jsonl").read_text().splitlines():
            metrics = json.loads(line).get("metrics", {})
            if "time/blocked_s" in metrics and "time/elapsed_s" in metrics:
                last = metrics
        if last is None:
            raise ValueError(f"{run_dir}/live/rank{r}.jsonl has no time/blocked_s and time/elapsed_s metrics")
        out.append(utilisation_of(last["time/blocked_s"], last["time/elapsed_s"]))
    return out


def torchft_fragments(h: int, want: int) -> int:
    """torchft's DiLoCo needs sync_every divisible by the fragment count (ours does not): the divisor of H nearest
    `want`, the larger on a tie (smaller fragments: the kinder choice for the reference). H=20 -> 4, H=50 -> 5."""
    return min((f for f in range(1, h + 1) if h % f == 0), key=lambda f: (abs(f - want), -f))


def _load() -> float:
    return os.getloadavg()[0]


# ---- torchft ------------------------------------------------------------------------------------------

_LIGHTHOUSE = """
import json, sys, time
from torchft._torchft import LighthouseServer
server = LighthouseServer(bind="[::]:0", **json.loads(sys.argv[1]))
print(server.address().rsplit(":", 1)[1], flush=True)
while True:
    time.sleep(3600)
"""


def run_torchft(
    ctx: BenchContext,
    label: str,
    base: dict,
    h: int,
    fragments: int,
    delay: int,
    bed=None,
    threads: int = 1,
    limit_s: float = 600.0,
) -> dict:
    """Two torchft replicas (one per island; on the testbed's hosts 0 and 1, or on loopback without `bed`)."""
    from islands.config import dump_json

    cfg = ctx.config(islands=2, outer=f"diloco:inner_steps={h}", **base)  # the task; torchft runs the outer part
    run_dir = ctx.out_dir / "runs" / label
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    dump_json(cfg, run_dir / "config.json")
    replicas = 2

    def argv(host: int, args: list[str]) -> list[str]:
        return bed.wrap(host, args) if bed is not None else args

    def env(host: int) -> dict:
        return {
            **os.environ,
            **(bed.env(host) if bed is not None else {}),
            "OMP_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
        }

    def ip(host: int) -> str:
        return bed.host(host).ip if bed is not None else "127.0.0.1"

    with ctx.arm(label):
        ctx.log(
            f"run {label}: torchft DiLoCo, 2 replicas, H={h}, fragments={fragments}, delay={delay}, "
            f"link={bed.rate if bed is not None else 'loopback'}"
        )
        settings = {
            "min_replicas": replicas,
            "join_timeout_ms": 60000,
            "quorum_tick_ms": 100,
            "heartbeat_timeout_ms": 5000,
        }
        lighthouse = subprocess.Popen(
            argv(0, [sys.executable, "-c", _LIGHTHOUSE, json.dumps(settings)]),
            env=env(0),
            stdout=subprocess.PIPE,
            stderr=open(run_dir / "logs" / "lighthouse.log", "w"),  # noqa: SIM115 - the child process writes its log after this returns
            text=True,
        )
        procs = []
        load0, t0 = _load(), time.perf_counter()
        try:
            port = lighthouse.stdout.readline().strip()
            if not port.isdigit():
                raise RuntimeError(
                    f"torchft lighthouse did not start: {(run_dir / 'logs' / 'lighthouse.log').read_text()[-800:]}"
                )
            barrier = run_dir / "go"
            barrier.unlink(missing_ok=True)
            for r in range(replicas):
                spec = {
                    "config": str(run_dir / "config.json"),
                    "lighthouse": f"http://{ip(0)}:{port}",
                    "name": f"r{r}",
                    "shard": r,
                    "shards": replicas,
                    "inner_steps": h,
                    "fragments": fragments,
                    "delay": delay,
                    "outer_lr": 2**0.5,
                    "ip": ip(r),
                    "threads": threads,
                    "out": str(run_dir / f"r{r}.json"),
                    "barrier": str(barrier),
                    "start_limit_s": limit_s,
                    "timeout_s": 120.0,
                }
                Path(spec["out"]).unlink(missing_ok=True)
                (run_dir / f"r{r}.spec.json").write_text(json.dumps(spec))
                procs.append(
                    subprocess.Popen(
                        argv(
                            r,
                            [
                                sys.executable,
                                "-m",
                                "islands_bench.experiments.utilisation_torchft_worker",
                                str(run_dir / f"r{r}.spec.json"),
                            ],
                        ),
                        env=env(r),
                        stdout=open(run_dir / "logs" / f"r{r}.log", "w"),  # noqa: SIM115 - the child process writes its log after this returns
                        stderr=subprocess.STDOUT,
                    )
                )
            deadline = time.time() + limit_s
            while not all((run_dir / f"r{r}.json.ready").exists() for r in range(replicas)):
                dead = [p.poll() for p in procs if p.poll() is not None]
                if dead or time.time() > deadline:
                    raise RuntimeError(
                        f"torchft replicas did not start (exit codes {dead}); logs in {run_dir / 'logs'}"
                    )
                time.sleep(0.02)
            barrier.write_text(str(time.time()))
            for r, p in enumerate(procs):
                code = p.wait(timeout=max(deadline - time.time(), 1.0))
                if code != 0:
                    tail = (run_dir / "logs" / f"r{r}.log").read_text()[-2000:]
                    raise RuntimeError(f"torchft replica r{r} exited with {code}; log tail:\n{tail}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            lighthouse.kill()
            lighthouse.wait(timeout=30)
    out = json.loads((run_dir / "r0.json").read_text())
    per = [json.loads((run_dir / f"r{r}.json").read_text()) for r in range(replicas)]
    out.update(
        label=label,
        load=max(load0, _load()),
        launch_seconds=time.perf_counter() - t0,
        workers_utilisation=[utilisation_of(o["blocked_seconds"], o["wall_seconds"]) for o in per],
    )
    return out


# ---- the experiment -------------------------------------------------------------------------------------


def _plot(result, path):
    rows = [r for r in result["rows"] if r["link"] != "loopback"]
    links = list(dict.fromkeys(r["link"] for r in rows))
    with figure(path, 1, len(links), figsize=(4.5 * len(links), 4)) as (fig, ax):
        ax = ax if len(links) > 1 else [ax]
        for a, link in zip(ax, links):
            here = [r for r in rows if r["link"] == link]
            a.barh([r["run"].rsplit("@", 1)[0] for r in here], [100 * r["utilisation"] for r in here])
            a.axvline(100 * GOALS.get(link, 1.0), color="k", lw=0.8, ls="--")
            a.set_xlim(min(100 * r["utilisation"] for r in here) - 2, 100.5)
            a.set_title(f"testbed link {link}", fontsize=9)
            a.set_xlabel("compute utilisation (%)")
            a.tick_params(axis="y", labelsize=7)
        fig.suptitle(f"utilisation{' (quick)' if result['quick'] else ''}: 1 - blocked / wall, 2 islands", fontsize=9)


@experiment(
    "utilisation",
    practices=("SOTA-155", "SOTA-214", "SOTA-902", "SOTA-904", "SOTA-905", "SOTA-912"),
    help="compute utilisation (1 - blocked/wall) and step time vs no link on 100/20/5 Mbit/s testbed links: "
    "DiLoCo, streaming, async (delayed) and eager outer steps, fp32 and topkq, against torchft's "
    "DiLoCo and streaming DiLoCo",
)
def utilisation(ctx: BenchContext) -> dict:
    from islands_bench.experiments.churn_torchft import load_torchft

    links = ("20mbit", "5mbit") if ctx.quick else ("100mbit", "20mbit", "5mbit")
    # full: the setting (200 steps, H=50); quick: 3 rounds of H=20, the compressor on DiLoCo and eager only
    steps, h = (60, 20) if ctx.quick else (200, 50)
    model = {}
    if ctx.smoke:  # 2 rounds of H=8 on a tiny LM; one link, on which DiLoCo and torchft's DiLoCo alone run again
        links, ctx.smoke_steps, steps, h = links[:1], 16, 16, 8
        model = SMOKE_LM
    base = dict(
        task="lm",
        steps=steps,
        global_batch=32,
        warmup=max(steps // 10, 1),
        eval_every=0,
        workers=2,
        log_every=max(steps // 10, 1),
        **model,
    )
    islands_arms = [
        (f"{name}{'' if c is None else '+topkq'}", with_compressor(spec, c))
        for c in (None, COMPRESSOR)
        for name, spec in arms(h)
        if not (ctx.quick and c is not None and name not in ("diloco", "eager"))
    ]
    islands_arms.append(("eager+topkq146x", with_compressor(dict(arms(h))["eager"], COMPRESSOR_146X)))
    # deadline rounds behind the overlap: the islands end each round at the same wall time, so the skew of two
    # islands on shared cores is not paid at the end (adaptive.py, catching up)
    islands_arms += [
        (f"{arm}+deadline", f"{with_compressor(dict(arms(h))['eager'], c)},adapt=deadline")
        for arm, c in (("eager+topkq", COMPRESSOR), ("eager+topkq146x", COMPRESSOR_146X))
    ]
    version, why_not = load_torchft(ctx.log)
    # torchft's streaming needs its delay (2) below H/F: at the smoke tier's H=8, 2 fragments
    torchft_arms = (
        [("torchft-diloco", 1, 0), ("torchft-streaming", torchft_fragments(h, 2 if ctx.smoke else 4), 2)]
        if version
        else []
    )
    if ctx.smoke:  # one arm of each kind: DiLoCo, streaming, async, eager with topkq, with 146x and deadline rounds
        keep = ("diloco", "streaming", "async", "eager+topkq", "eager+topkq146x+deadline")
        islands_arms = [a for a in islands_arms if a[0] in keep]
    on_link = (lambda arms: arms[:1]) if ctx.smoke else (lambda arms: arms)  # smoke: DiLoCo's alone on the link
    ctx.plan(len(islands_arms) + len(torchft_arms) + len(links) * len(on_link(islands_arms) + on_link(torchft_arms)))
    uptime = [f"start {time.strftime('%H:%M:%S')} load {os.getloadavg()}"]
    rows, recs, torchft_errors = [], {}, []

    def islands_row(label, arm, spec, link, rec, load):
        s = rec["summary"]
        workers = worker_utilisation(ctx.out_dir / "runs" / label, s["workers"])
        return {
            "run": label,
            "arm": arm,
            "link": link,
            "utilisation": sum(workers) / len(workers),
            "utilisation_rank0": utilisation_of(s["sync_blocked_seconds"], s["wall_seconds"]),
            "blocked_s": s["sync_blocked_seconds"],
            "wall_s": s["wall_seconds"],
            "s_per_step": s["wall_seconds"] / s["steps"],
            "median_s_per_step": s["median_seconds_per_step"],
            "final_val_loss": s["final_val_loss"],
            "mb_per_worker": s["mb_sent_per_worker"],
            "load": load,
            "spec": spec,
            "interconnect": rec["interconnect_line"],
        }

    def torchft_row(label, arm, link, out, fragments, delay):
        workers = out["workers_utilisation"]
        return {
            "run": label,
            "arm": arm,
            "link": link,
            "utilisation": sum(workers) / len(workers),
            "utilisation_rank0": utilisation_of(out["blocked_seconds"], out["wall_seconds"]),
            "blocked_s": out["blocked_seconds"],
            "wall_s": out["wall_seconds"],
            "s_per_step": out["wall_seconds"] / out["steps"],
            "median_s_per_step": None,
            "final_val_loss": out["final_val_loss"],
            "mb_per_worker": None,
            "load": out["load"],
            "spec": f"torchft {version} DiLoCo sync_every={h} fragments={fragments} fragment_sync_delay={delay}",
            "interconnect": f"testbed {link} (torchft's ProcessGroupGloo)"
            if link != "loopback"
            else "gloo loopback (torchft's ProcessGroupGloo)",
        }

    def run_all(link: str, bed) -> None:
        kw = {} if bed is None else {"testbed": bed.name}
        for arm, spec in islands_arms if bed is None else on_link(islands_arms):
            label = f"{arm}@{link}"
            load0 = _load()
            rec = ctx.train(label, islands=2, outer=spec, **kw, **base)
            recs[label] = rec
            rows.append(islands_row(label, arm, spec, link, rec, max(load0, _load())))
        threads = recs[f"diloco@{link}"]["world"]["threads_per_worker"]
        for arm, fragments, delay in torchft_arms if bed is None else on_link(torchft_arms):
            label = f"{arm}@{link}"
            try:
                out = run_torchft(ctx, label, base, h, fragments, delay, bed=bed, threads=threads)
            except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as exc:  # the reference failing is a result
                torchft_errors.append(f"{label}: {exc}")
                ctx.log(f"torchft run {label} failed: {exc}")
                continue
            rows.append(torchft_row(label, arm, link, out, fragments, delay))

    run_all("loopback", None)
    for link in links:
        with ctx.testbed(link, hosts=2) as bed:
            run_all(link, bed)
    uptime.append(f"end {time.strftime('%H:%M:%S')} load {os.getloadavg()}")

    by = {(r["arm"], r["link"]): r for r in rows}
    ref_loss = by[("diloco", "loopback")]["final_val_loss"]
    for r in rows:
        nolink = by.get((r["arm"], "loopback"))
        r["step_time_vs_no_link"] = r["s_per_step"] / nolink["s_per_step"] if nolink else None
        r["loss_vs_diloco_pct"] = gap_pct(r["final_val_loss"], ref_loss)

    headline = []
    for link in links:
        here = [r for r in rows if r["link"] == link]
        best = max((r for r in here if not r["arm"].startswith("torchft")), key=lambda r: r["utilisation"])
        ft = [r for r in here if r["arm"].startswith("torchft")]
        ft_best = max(ft, key=lambda r: r["utilisation"]) if ft else None
        goal = GOALS.get(link)
        words = (
            f"testbed link {link}: "
            + ", ".join(f"{r['arm']} {100 * r['utilisation']:.1f}%" for r in here)
            + f"; best {best['arm']} {100 * best['utilisation']:.2f}% (rank 0 "
            f"{100 * best['utilisation_rank0']:.2f}%, step time x{best['step_time_vs_no_link']:.2f} of its "
            f"no-link run, loss {best['final_val_loss']:.4f})"
        )
        if goal is not None:
            met = best["utilisation"] >= goal and (ft_best is None or best["utilisation"] > ft_best["utilisation"])
            ft_words = f"best torchft {100 * ft_best['utilisation']:.1f}%" if ft_best else "torchft not run"
            words += f"; goal >= {100 * goal:.0f}% and ahead of torchft ({ft_words}): {'met' if met else 'not met'}"
        headline.append(words)
    headline.append(
        f"final val loss (no link), vs DiLoCo {ref_loss:.4f}: "
        + ", ".join(f"{r['arm']} {r['loss_vs_diloco_pct']:+.1f}%" for r in rows if r["link"] == "loopback")
    )
    headline.append(
        f"byte LM, {steps} steps, H={h}, 2 islands of 1 worker, global batch 32; utilisation = the "
        f"workers' mean of 1 - blocked/wall (utilisation_rank0: rank 0's alone; blocked includes the "
        f"faster island waiting for the slower; torchft: the time in its optimizer post-hook, and it ends "
        f"without a final synchronisation); blocked_s, wall_s: rank 0's; the no-link runs are "
        f"gloo loopback; load average (2 cores shared with other jobs): {'; '.join(uptime)}"
    )
    if not version:
        headline.append(f"torchft not run: {why_not}")
    headline += [f"torchft run failed: {e}" for e in torchft_errors]
    return {
        "rows": rows,
        "headline": headline,
        "plot": _plot,
        "torchft": version,
        "torchft_errors": torchft_errors,
        "uptime": uptime,
        "steps": steps,
        "inner_steps": h,
    }
