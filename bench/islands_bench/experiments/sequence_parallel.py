"""sequence-parallel (SOTA-058): a tensor-parallel MLP block with and without sequence parallelism.

Two ranks, one block (layer norm, d -> 4d -> d, dropout 0.1, residual). Per sequence length, in
the same process pair and interleaved: held activation bytes per rank (saved-tensor hooks, exact),
bytes each rank sends per forward+backward (the ledger), and the step time.
"""

from __future__ import annotations

import json
import sys

from islands_bench.harness import BenchContext, experiment
from islands_bench.spawn import join_world, run_module_ranks, testbed_rates, time_interleaved

D_MODEL, HIDDEN, DROPOUT = 256, 1024, 0.1


def _worker(out_path: str, seqs: list[int], reps: int, rate: str) -> None:
    import torch

    from islands import close_world
    from islands.measure import describe
    from islands.parallel import TensorParallelMLP, sequence_shard

    world, inter = join_world(rate)
    comm = world.comm("global")
    rows = []
    for seq in seqs:
        torch.manual_seed(0)
        blocks = {sp: TensorParallelMLP(D_MODEL, HIDDEN, comm, sequence_parallel=sp, dropout=DROPOUT) for sp in (0, 1)}
        x = torch.randn(seq, D_MODEL)
        inputs = {0: x, 1: sequence_shard(x, comm).clone()}

        def step(sp, held=None, *, inputs=inputs, blocks=blocks):
            xin = inputs[sp].clone().requires_grad_(True)
            if held is None:
                y = blocks[sp](xin)
            else:  # held[0]: every saved tensor; held[1]: those saved inside the norm and dropout
                where = [False]
                region = (blocks[sp].norm, blocks[sp].drop)
                hooks = [m.register_forward_pre_hook(lambda *_: where.__setitem__(0, True)) for m in region]
                hooks += [m.register_forward_hook(lambda *_: where.__setitem__(0, False)) for m in region]

                def pack(t):
                    held[0] += t.numel() * t.element_size()
                    held[1] += t.numel() * t.element_size() if where[0] else 0
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    y = blocks[sp](xin)
                for h in hooks:
                    h.remove()
            y.sum().backward()
            blocks[sp].reduce_replicated_grads()

        row = {"seq": seq}
        for sp in (0, 1):
            held, sent0 = [0, 0], world.ledger.snapshot()["sent"]
            step(sp, held)
            sent = world.ledger.snapshot()["sent"]
            row[f"held_{sp}"], row[f"region_{sp}"] = held
            row[f"sent_{sp}"] = {k: v - sent0.get(k, 0) for k, v in sent.items() if v != sent0.get(k, 0)}
        seconds = time_interleaved({0: lambda: step(0), 1: lambda: step(1)}, reps)
        row["ms_0"], row["ms_1"] = 1000 * seconds[0], 1000 * seconds[1]
        rows.append(row)
    if world.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"rows": rows, "interconnect_line": describe(inter)}, f)
    close_world(world)


@experiment(
    "sequence-parallel",
    practices=("SOTA-058",),
    help="tensor-parallel MLP block with vs without sequence parallelism: held bytes, bytes sent, step time",
)
def sequence_parallel(ctx: BenchContext) -> dict:
    seqs = [256] if ctx.smoke else [256, 1024] if ctx.quick else [256, 1024, 4096]
    reps = 1 if ctx.smoke else 7 if ctx.quick else 15
    module = "islands_bench.experiments.sequence_parallel"
    links = [("loopback", None)] + [(rate, rate) for rate in testbed_rates(ctx)[:1]]
    rows, lines = [], []
    for label, rate in links:
        args = [json.dumps(seqs), str(reps)]
        out = ctx.out_dir / f"{label}.json"
        if rate is None:
            res = run_module_ranks(module, args, 2, out)
        else:
            with ctx.testbed(rate, hosts=2) as bed:
                res = run_module_ranks(module, args, 2, out, bed)
        lines.append(res["interconnect_line"])
        for r in res["rows"]:
            replicated = r["sent_1"].get("sp_grad_all_reduce", 0)
            rows.append(
                {
                    "link": label,
                    "seq": r["seq"],
                    "held_tp_bytes": r["held_0"],
                    "held_tp_sp_bytes": r["held_1"],
                    "held_ratio": round(r["held_0"] / r["held_1"], 3),
                    "region_tp_bytes": r["region_0"],
                    "region_tp_sp_bytes": r["region_1"],
                    "region_ratio": round(r["region_0"] / r["region_1"], 3),
                    "sent_tp_bytes": sum(r["sent_0"].values()),
                    "sent_tp_sp_bytes": sum(r["sent_1"].values()) - replicated,
                    "sent_replicated_grads": replicated,
                    "ms_tp": round(r["ms_0"], 2),
                    "ms_tp_sp": round(r["ms_1"], 2),
                    "time_ratio_sp_over_tp": round(r["ms_1"] / r["ms_0"], 3),
                    "interconnect": res["interconnect_line"],
                }
            )
    big = max(seqs)
    headline = []
    for label, _ in links:
        r = next(x for x in rows if x["link"] == label and x["seq"] == big)
        headline.append(
            f"{r['interconnect']}: {big} positions, d={D_MODEL}, 2 tensor-parallel ranks: the norm and dropout "
            f"region holds {r['region_tp_sp_bytes']:,} B per rank with sequence parallelism vs "
            f"{r['region_tp_bytes']:,} B "
            f"without ({r['region_ratio']:.2f}x less; the whole block {r['held_ratio']:.2f}x less), while each rank "
            f"sends {r['sent_tp_sp_bytes']:,} vs {r['sent_tp_bytes']:,} B per forward+backward (plus "
            f"{r['sent_replicated_grads']:,} B of replicated norm/bias gradients); step {r['ms_tp_sp']} vs "
            f"{r['ms_tp']} ms "
            f"({r['time_ratio_sp_over_tp']:.2f}x)"
        )
    return {
        "rows": rows,
        "headline": headline,
        "interconnect": lines,
        "baseline": [
            "the same tensor-parallel block without sequence parallelism (whole sequence on every rank, "
            "all-reduce), same ranks and run, interleaved; 1 thread per rank, fp32"
        ],
    }


if __name__ == "__main__":
    _worker(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
