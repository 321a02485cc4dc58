"""matmul-overlap (SOTA-059): a matmul and its all-reduce pipelined in chunks vs issued back to back.

Two ranks each hold half of a row-parallel layer's input features; the layer's output is the sum of
their partial products (islands.parallel.matmul_all_reduce). Per shape and chunk count we time the
whole op side by side in one process pair (chunk counts interleaved every repetition), plus the
matmul alone and the all-reduce alone, so each row can be read against the ideal overlap
(compute + comm) / max(compute, comm). Run on gloo loopback and on real tbf-shaped testbed links.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from islands_bench.harness import BenchContext, experiment
from islands_bench.spawn import run_module_ranks, testbed_rates, time_interleaved

CHUNKS = (1, 2, 4, 8)
CITED_SPEEDUP = 1.36  # LIT-735's chunked matmul + collective vs back to back


def _worker(out_path: str, shapes: list[list[int]], reps: int, rate: str) -> None:
    import torch

    from islands import close_world
    from islands.measure import describe
    from islands.parallel import matmul_all_reduce
    from islands_bench.spawn import join_world

    world, inter = join_world(rate)
    comm = world.comm("global")
    rows = []
    for m, k, n in shapes:
        g = torch.Generator().manual_seed(world.rank)
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
        ops = {f"chunks={c}": (lambda c=c, x=x, w=w: matmul_all_reduce(x, w, comm, chunks=c)) for c in CHUNKS}
        ops["matmul only"] = lambda x=x, w=w: x @ w.T
        ops["all-reduce only"] = lambda m=m, n=n: comm.all_reduce(torch.empty(m, n))
        seconds = time_interleaved(ops, reps)
        rows.append({"shape": [m, k, n], "ms": {name: 1000 * v for name, v in seconds.items()}})
    if world.rank == 0:
        Path(out_path).write_text(
            json.dumps({"rows": rows, "interconnect": inter, "interconnect_line": describe(inter)})
        )
    close_world(world)


def _launch_pair(out: Path, shapes, reps: int, bed=None) -> dict:
    return run_module_ranks("islands_bench.experiments.matmul_overlap", [json.dumps(shapes), str(reps)], 2, out, bed)


def _rows_of(link: dict, label: str) -> list[dict]:
    rows = []
    for r in link["rows"]:
        ms = r["ms"]
        base, compute, comm = ms["chunks=1"], ms["matmul only"], ms["all-reduce only"]
        ideal = (compute + comm) / max(compute, comm)
        for c in CHUNKS:
            rows.append(
                {
                    "link": label,
                    "m_k_n": "x".join(map(str, r["shape"])),
                    "chunks": c,
                    "ms": round(ms[f"chunks={c}"], 2),
                    "speedup_vs_back_to_back": round(base / ms[f"chunks={c}"], 3),
                    "matmul_ms": round(compute, 2),
                    "all_reduce_ms": round(comm, 2),
                    "ideal_speedup": round(ideal, 3),
                    "interconnect": link["interconnect_line"],
                }
            )
    return rows


def _plot(result, path):
    from islands_bench.plots import figure

    with figure(path, figsize=(7, 4)) as (fig, ax):
        for key in sorted({(r["link"], r["m_k_n"]) for r in result["rows"]}):
            pts = [r for r in result["rows"] if (r["link"], r["m_k_n"]) == key]
            ax.plot(
                [r["chunks"] for r in pts],
                [r["speedup_vs_back_to_back"] for r in pts],
                marker="o",
                label=f"{key[0]} {key[1]}",
            )
        ax.axhline(CITED_SPEEDUP, ls="--", c="grey", label=f"cited {CITED_SPEEDUP}x (LIT-735)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("chunks")
        ax.set_ylabel("speed-up vs matmul then all-reduce")
        ax.legend(fontsize=7)


@experiment(
    "matmul-overlap",
    practices=("SOTA-059",),
    help="a row-parallel matmul and its all-reduce pipelined in chunks vs back to back, per link",
)
def matmul_overlap(ctx: BenchContext) -> dict:
    # k sets the balance: flops 2mkn against 4mn bytes, so k/2 flop per byte sent
    shapes = (
        [[1024, 256, 1024], [1024, 1024, 1024]]
        if ctx.quick
        else [[1024, 256, 1024], [1024, 1024, 1024], [1024, 4096, 1024]]
    )
    reps = 9 if ctx.quick else 21
    if ctx.smoke:  # one small shape, one repeat
        shapes, reps = [[256, 256, 256]], 1
    rates = testbed_rates(ctx)
    rows, lines = [], []
    ctx.log("loopback pair")
    link = _launch_pair(ctx.out_dir / "loopback.json", shapes, reps)
    rows += _rows_of(link, "loopback")
    lines.append(link["interconnect_line"])
    for rate in rates:
        ctx.log(f"testbed pair at {rate}")
        with ctx.testbed(rate, hosts=2) as bed:
            link = _launch_pair(ctx.out_dir / f"testbed-{rate}.json", shapes, reps, bed)
        rows += _rows_of(link, rate)
        lines.append(link["interconnect_line"])
    headline = []
    for label in dict.fromkeys(r["link"] for r in rows):
        mine = [r for r in rows if r["link"] == label and r["chunks"] > 1]
        best = max(mine, key=lambda r: r["speedup_vs_back_to_back"])
        headline.append(
            f"{best['interconnect']}: best {best['speedup_vs_back_to_back']:.2f}x faster than matmul-then-all-reduce "
            f"at {best['chunks']} chunks for m x k x n = {best['m_k_n']} (matmul {best['matmul_ms']} ms, "
            f"all-reduce {best['all_reduce_ms']} ms alone; ideal overlap {best['ideal_speedup']:.2f}x; "
            f"cited {CITED_SPEEDUP}x); same bytes sent for every chunk count"
        )
    return {
        "rows": rows,
        "headline": headline,
        "plot": _plot,
        "interconnect": lines,
        "baseline": [
            "the same matmul followed by one all-reduce of its whole output (chunks=1), same ranks, "
            "same run, interleaved; 2 processes with 1 thread each, fp32, times = max over ranks "
            "of the median"
        ],
    }


if __name__ == "__main__":
    _worker(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
