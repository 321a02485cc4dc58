"""sharding-crossover (Q-1, SOTA-116, SOTA-030): DDP against FSDP across model sizes and interconnects.

For each model width both strategies train the same byte LM on the same global batch, side by side in one
invocation: on loopback at 2 (and 4) workers, and between 2 hosts of a real rate-limited testbed. The
table gives what FSDP saves (per-rank parameter + gradient + optimizer bytes) and what it costs (step
time, wire bytes) on each link.
"""

from __future__ import annotations

from islands_bench.experiments.sharding_common import lm_config, ratio, run_row
from islands_bench.harness import BenchContext, experiment
from islands_bench.plots import figure

LINKS_QUICK = ("1gbit", "100mbit")


def _plot(result: dict, path) -> None:
    rows = result["rows"]
    with figure(path, 1, 2, figsize=(10, 4)) as (fig, (a, b)):
        for (link, workers), group in _pairs(rows).items():
            ds = sorted(group)
            a.plot(ds, [group[d]["time_ratio"] for d in ds], marker="o", label=f"{link}, {workers} workers")
        a.axhline(1.0, color="grey", lw=0.8)
        a.set_xscale("log", base=2)
        a.set_xlabel("d_model")
        a.set_ylabel("FSDP / DDP step time")
        a.legend(fontsize=7)
        loop = [r for r in rows if r["link"] == "loopback" and r["workers"] == 2]
        for strategy in ("ddp", "fsdp"):
            pts = sorted((r["d_model"], r["state_mb_per_rank"]) for r in loop if r["strategy"] == strategy)
            b.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=strategy)
        b.set_xscale("log", base=2)
        b.set_yscale("log")
        b.set_xlabel("d_model")
        b.set_ylabel("params+grads+AdamW MB per rank (2 workers)")
        b.legend(fontsize=8)
        fig.suptitle("sharding-crossover: what FSDP's memory costs in time, per interconnect", fontsize=9)


def _pairs(rows: list[dict]) -> dict:
    """{(link, workers): {d_model: {time_ratio, wire_ratio, memory_ratio}}} from side-by-side rows."""
    out: dict = {}
    for r in rows:
        if r["strategy"] != "fsdp":
            continue
        ddp = next(
            x
            for x in rows
            if x["strategy"] == "ddp"
            and x["link"] == r["link"]
            and x["workers"] == r["workers"]
            and x["d_model"] == r["d_model"]
        )
        out.setdefault((r["link"], r["workers"]), {})[r["d_model"]] = {
            "time_ratio": ratio(r["s_per_step"], ddp["s_per_step"]),
            "extra_s": r["s_per_step"] - ddp["s_per_step"],
            "wire_ratio": ratio(r["wire_mb_per_step"], ddp["wire_mb_per_step"]),
            "memory_ratio": ratio(r["state_mb_per_rank"], ddp["state_mb_per_rank"]),
            "saved_mb": ddp["state_mb_per_rank"] - r["state_mb_per_rank"],
        }
    return out


@experiment(
    "sharding-crossover",
    practices=("Q-1", "SOTA-116", "SOTA-030"),
    help="DDP vs FSDP across model sizes on loopback and rate-limited links: memory saved, time paid",
)
def sharding_crossover(ctx: BenchContext) -> dict:
    quick = ctx.quick
    layers, steps, bed_steps = (2, 6, 4) if quick else (4, 20, 10)
    widths = (64, 256, 512) if quick else (64, 128, 256, 512)
    plan = [("loopback", 2, widths), ("loopback", 4, (128, 512) if quick else widths)]
    links = (ctx.rate,) if ctx.rate else LINKS_QUICK
    plan += [(link, 2, (64, 512) if quick else widths) for link in links]
    if ctx.smoke:  # one width, DDP and FSDP, on loopback and on one testbed link
        plan = [("loopback", 2, (64,)), (links[-1], 2, (64,))]
    rows = []
    for link, workers, ds in plan:

        def one(testbed="", *, link=link, workers=workers, ds=ds):
            for d in ds:
                for inner in ("ddp", "fsdp"):
                    cfg = lm_config(
                        d,
                        layers,
                        bed_steps if testbed else steps,
                        workers,
                        inner=inner,
                        **({"wrap": "block"} if inner == "fsdp" else {}),
                    )
                    rows.append({"link": link, **run_row(ctx, f"{link}-{workers}w-d{d}-{inner}", cfg, testbed)})

        if link == "loopback":
            one()
        else:
            with ctx.testbed(link, hosts=workers) as bed:
                one(bed.name)
    pairs = _pairs(rows)
    headline = []
    for (link, workers), group in pairs.items():
        d_small, d_big = min(group), max(group)
        s, b = group[d_small], group[d_big]
        headline.append(
            f"{link}, {workers} workers: FSDP holds {100 * b['memory_ratio']:.0f}% of DDP's per-rank state "
            f"(saves {b['saved_mb']:.1f} MB at d={d_big}) and steps {b['time_ratio']:.2f}x DDP's time at d={d_big} "
            f"({b['extra_s']:+.3f} s/step), {s['time_ratio']:.2f}x at d={d_small}; wire bytes {b['wire_ratio']:.2f}x"
        )
    faster = [f"{k[0]} {k[1]}w d={d}" for k, g in pairs.items() for d, v in g.items() if v["time_ratio"] < 1]
    headline.append(
        f"FSDP stepped faster than DDP in {len(faster)} of {sum(len(g) for g in pairs.values())} "
        f"pairs ({', '.join(faster) or 'none'}); every replica here fits in memory, so sharding only "
        "buys memory; it pays where a replica no longer fits one device (SOTA-116), which these sizes "
        "do not reach"
    )
    headline.append(
        "baseline: per worker, one process with 1 thread; 4 workers share 2 cores, so their time "
        "ratios include oversubscription; load_avg in each row shows what else ran on the machine"
    )
    return {"rows": rows, "headline": headline, "plot": _plot, "pairs": {f"{k[0]}|{k[1]}": v for k, v in pairs.items()}}
