"""compressor-throughput: GB/s of gradient each compressor turns into a payload and back, next to a memcpy.

In one process, on the default LM's parameter shapes: per tensor, the agreement (if any), compress,
then decode (absorb + decompress for summable payloads, combine_gathered for gathered ones), as one
rank does inside compress_and_average minus the collectives. The reference is a plain copy of the
same tensors into preallocated buffers, timed in the same run on the same thread.
"""

from __future__ import annotations

import torch

from islands.compress import Agreed, Combine, parse_compressor
from islands.measure import best_seconds
from islands.models import ByteTransformer
from islands_bench.harness import BenchContext, experiment
from islands_bench.plots import figure

SPECS = [
    "none",
    "fp16",
    "bf16",
    "int8",
    "int4",
    "qsgd:levels=16",
    "randomk:ratio=0.01",
    "topk:ratio=0.01,warmup=0",
    "topk:ratio=0.001,warmup=0",
    "topk:ratio=0.01,warmup=0,sample=0.01",
    "topk:ratio=0.001,warmup=0,sample=0.01",
    "powersgd:rank=4",
    "sign",
]


def _roundtrip(c, grads: dict[str, torch.Tensor]) -> None:
    for name, g in grads.items():
        st = c.state(name, g)
        agreed = Agreed(c.agree(g, st), 1)
        p = c.compress(g, st, agreed)
        if c.combine is Combine.SUMMABLE:
            c.absorb(st, p)
            c.decompress(p)
        else:
            c.combine_gathered([p])


def _copy(grads: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> None:
    for name, g in grads.items():
        out[name].copy_(g)


def _plot(result: dict, path) -> None:
    rows = result["rows"]
    with figure(path, figsize=(7, 4)) as (fig, ax):
        ax.barh([r["compressor"] for r in rows], [r["gb_per_s"] for r in rows])
        ax.set_xscale("log")
        ax.set_xlabel("GB/s of fp32 gradient (compress + decode), log scale")
        ax.set_title(f"compressor-throughput, {result['gradient_mb']:.1f} MB gradient, {result['where']}", fontsize=9)


@experiment(
    "compressor-throughput",
    practices=("SOTA-075",),
    help="GB/s of gradient processed by each compressor (compress + decode) next to a memory copy, one thread",
    devices=("cpu", "cuda"),
)
def compressor_throughput(ctx: BenchContext) -> dict:
    torch.set_num_threads(1)
    device = torch.device(ctx.device)
    where = "one CPU thread" if device.type == "cpu" else f"{torch.cuda.get_device_name(device)}"
    reps = 3 if ctx.quick else 10
    g = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(p.shape, generator=g).to(device) for n, p in ByteTransformer().named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in grads.values())
    out = {n: torch.empty_like(t) for n, t in grads.items()}
    copy_s = best_seconds(lambda: _copy(grads, out), reps * 3, device=device)
    rows = [
        {"compressor": "memcpy (reference)", "seconds": copy_s, "gb_per_s": nbytes / copy_s / 1e9, "vs_memcpy": 1.0}
    ]
    for spec in SPECS:
        c = parse_compressor(spec)
        s = best_seconds(lambda c=c: _roundtrip(c, grads), reps, device=device)
        rows.append({"compressor": spec, "seconds": s, "gb_per_s": nbytes / s / 1e9, "vs_memcpy": copy_s / s})
    ranked = sorted(rows[1:], key=lambda r: r["gb_per_s"])
    slow, fast = ranked[0], ranked[-1]
    psgd = next(r for r in rows if r["compressor"] == "powersgd:rank=4")
    by = {r["compressor"]: r for r in rows}
    sampled = "; ".join(
        f"top-k {d} exact {by[f'topk:ratio={d},warmup=0']['gb_per_s']:.3f} vs sampled threshold "
        f"{by[f'topk:ratio={d},warmup=0,sample=0.01']['gb_per_s']:.3f} GB/s"
        for d in ("0.01", "0.001")
    )
    headline = [
        f"memcpy of the same {nbytes / 1e6:.1f} MB of gradients: {rows[0]['gb_per_s']:.2f} GB/s on {where}",
        f"fastest compressor {fast['compressor']} {fast['gb_per_s']:.2f} GB/s ({fast['vs_memcpy']:.2f}x memcpy); "
        "slowest "
        f"{slow['compressor']} {slow['gb_per_s']:.3f} GB/s ({slow['vs_memcpy']:.4f}x); PowerSGD rank 4 "
        f"{psgd['gb_per_s']:.2f} GB/s",
        f"DGC's threshold from a 1% sample (LIT-056; same selection, exact top-k of the candidates, tensors of "
        f">= 64 K entries only): {sampled}",
        f"in-process, no network: a compressor with throughput T and ratio c saves time only on links slower than "
        f"T (1 - 1/c) (x8 for Gbit/s), e.g. PowerSGD here below {8 * psgd['gb_per_s']:.2f} Gbit/s; best of {reps} "
        f"repetitions on {where}",
    ]
    return {
        "rows": rows,
        "headline": headline,
        "gradient_mb": nbytes / 1e6,
        "plot": _plot,
        "where": where,
        "interconnect": [f"none: in-process compute only, {where}"],
        "baseline": [f"copy of the same tensors into preallocated buffers on the same device ({where}), same run"],
    }
