"""ring-attention (SOTA-181): a sequence of n blocks over n ranks, its link cost and its memory.

Each rank holds one block of b positions. Per rank count we time, in the same processes and
interleaved: ring attention forward + backward over the whole sequence, and the identical arithmetic
with the link removed (a stand-in ring that hands each rank its own blocks back at once), so
ring / no-link is the share of the step the link adds. One hop (the k/v block to the next rank)
is timed alone beside one block's attention, the condition the practice names. Held activation
bytes are counted exactly with saved-tensor hooks, against whole-sequence attention on one device.
Non-causal, so every rank does the same work.
"""

from __future__ import annotations

import json
import sys

from islands_bench.harness import BenchContext, experiment
from islands_bench.spawn import held_bytes, join_world, run_module_ranks, testbed_rates, time_interleaved


class _NoLinkRing:
    """Same rank and size as the real ring, but each 'received' block is a copy of the one sent."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def exchange_async(self, sends, recv_from, like=None, kind=""):
        t = next(iter(sends.values()))
        return {recv_from[0]: t.clone()}, lambda: None


def _worker(out_path: str, block: int, heads: int, dim: int, reps: int, rate: str) -> None:
    import torch

    from islands import close_world
    from islands.measure import describe
    from islands.parallel import ring_attention

    world, inter = join_world(rate)
    comm, n, r = world.comm("global"), world.size, world.rank
    g = torch.Generator().manual_seed(r)
    q, k, v = (torch.randn(1, heads, block, dim, generator=g, requires_grad=True) for _ in range(3))
    fake = _NoLinkRing(r, n)

    def step(c):
        ring_attention(q, k, v, c, causal=False).sum().backward()

    def hop():
        if n > 1:
            got, wait = comm.exchange_async({(r + 1) % n: torch.stack([k.detach(), v.detach()])}, [(r - 1) % n])
            wait()

    def block_attention():
        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        (torch.softmax(qq @ kk.transpose(-2, -1) / dim**0.5, -1) @ vv).sum().backward()

    ops = {"ring": lambda: step(comm), "no_link": lambda: step(fake), "hop": hop, "block": block_attention}
    seconds = time_interleaved(ops, reps)
    held_ring = held_bytes(lambda: ring_attention(q, k, v, fake, causal=False))
    seq = n * block
    qf, kf, vf = (torch.randn(1, heads, seq, dim, requires_grad=True) for _ in range(3))
    held_full = held_bytes(lambda: torch.softmax(qf @ kf.transpose(-2, -1) / dim**0.5, -1) @ vf)
    if r == 0:
        with open(out_path, "w") as f:
            json.dump(
                {
                    "ms": {name: 1000 * x for name, x in seconds.items()},
                    "held_ring": held_ring,
                    "held_full": held_full,
                    "ranks": n,
                    "seq": seq,
                    "interconnect_line": describe(inter) if n > 1 else "none (one rank)",
                },
                f,
            )
    close_world(world)


def _plot(result, path):
    from islands_bench.plots import figure

    with figure(path, 1, 2, figsize=(10, 4)) as (fig, (a, b)):
        for link in dict.fromkeys(r["link"] for r in result["rows"]):
            pts = [r for r in result["rows"] if r["link"] == link]
            a.plot([r["ranks"] for r in pts], [r["link_overhead_pct"] for r in pts], marker="o", label=link)
        a.set_xlabel("ranks (sequence = ranks x block)")
        a.set_ylabel("step time the link adds (%)")
        a.legend(fontsize=7)
        pts = [r for r in result["rows"] if r["link"] == "loopback"]
        b.plot(
            [r["seq"] for r in pts],
            [r["held_full_bytes"] / 2**20 for r in pts],
            marker="o",
            label="whole sequence, 1 device",
        )
        b.plot([r["seq"] for r in pts], [r["held_ring_bytes"] / 2**20 for r in pts], marker="o", label="ring, per rank")
        b.set_xlabel("sequence length")
        b.set_ylabel("held activations (MiB)")
        b.legend(fontsize=7)


@experiment(
    "ring-attention",
    practices=("SOTA-181",),
    help="ring attention over 1-4 ranks: step time the link adds, one hop vs one block, held bytes per rank",
)
def ring_attention_bench(ctx: BenchContext) -> dict:
    block, heads, dim = (64, 2, 16) if ctx.smoke else (256, 4, 32) if ctx.quick else (512, 4, 32)
    reps = 1 if ctx.smoke else 7 if ctx.quick else 15
    counts = (1, 2) if ctx.quick else (1, 2, 4)
    rates = testbed_rates(ctx)
    args = [str(block), str(heads), str(dim), str(reps)]
    module = "islands_bench.experiments.ring_attention"
    rows, lines = [], []

    def add(link: str, res: dict) -> None:
        ms = res["ms"]
        rows.append(
            {
                "link": link,
                "ranks": res["ranks"],
                "seq": res["seq"],
                "ring_ms": round(ms["ring"], 2),
                "no_link_ms": round(ms["no_link"], 2),
                "link_overhead_pct": round(100 * (ms["ring"] / ms["no_link"] - 1), 1),
                "hop_ms": round(ms["hop"], 2),
                "block_attention_ms": round(ms["block"], 2),
                "held_ring_bytes": res["held_ring"],
                "held_full_bytes": res["held_full"],
                "interconnect": res["interconnect_line"],
            }
        )
        if res["ranks"] > 1:
            lines.append(res["interconnect_line"])

    for n in counts:
        ctx.log(f"loopback, {n} ranks")
        add("loopback", run_module_ranks(module, args, n, ctx.out_dir / f"loopback-{n}.json"))
    for rate in rates:
        for n in [c for c in counts if c > 1]:
            ctx.log(f"testbed {rate}, {n} ranks")
            with ctx.testbed(rate, hosts=n) as bed:
                add(rate, run_module_ranks(module, args, n, ctx.out_dir / f"{rate}-{n}.json", bed))
    top = max(counts)
    headline = []
    for link in dict.fromkeys(r["link"] for r in rows):
        row = next(r for r in rows if r["link"] == link and r["ranks"] == top)
        headline.append(
            f"{row['interconnect']}: a {row['seq']}-position sequence over {top} ranks ({block} each, {heads} heads x "
            f"{dim}): ring forward+backward {row['ring_ms']} ms vs {row['no_link_ms']} ms for the same arithmetic with "
            f"no link ({row['link_overhead_pct']:+.1f}%); one k/v hop {row['hop_ms']} ms vs one block's attention "
            f"{row['block_attention_ms']} ms"
        )
    one = next(r for r in rows if r["link"] == "loopback" and r["ranks"] == top)
    headline.append(
        f"held activations for {one['seq']} positions: {one['held_ring_bytes']:,} B per rank with the ring vs "
        f"{one['held_full_bytes']:,} B for whole-sequence attention on one device "
        f"({one['held_full_bytes'] / one['held_ring_bytes']:.1f}x); per-rank bytes stay flat as ranks are added "
        f"at a fixed block, so the longest sequence under a memory budget grows with the rank count"
    )
    return {
        "rows": rows,
        "headline": headline,
        "plot": _plot,
        "interconnect": sorted(set(lines)),
        "baseline": [
            "the same ring attention arithmetic in the same processes with the link removed (no_link), "
            "interleaved; whole-sequence softmax attention on one device for held bytes; 1 thread "
            "per rank, fp32, times = max over ranks of the median"
        ],
    }


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
