"""Functions behind `islands ckpt ls|verify|inspect|diff|compress|decompress`.

Each returns (data, renderable): plain data for scripts and tests, a rich renderable for the terminal.
The integrator wires the CLI verbs to these.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from islands.checkpoint.codec import safetensors_codec
from islands.checkpoint.errors import CheckpointMismatch, CorruptCheckpoint, NoCheckpoint
from islands.checkpoint.store.directory import _STEP_DIR, CheckpointStore
from islands.checkpoint.store.manifest import data_name, manifest_name, read_manifest


def _locate(path: str | os.PathLike) -> tuple[CheckpointStore, int]:
    """A step directory -> (store over its parent, step)."""
    p = Path(path)
    m = _STEP_DIR.match(p.name)
    if not m or not p.is_dir():
        raise ValueError(f"{p} is not a checkpoint directory (expected a path like ROOT/step-000120)")
    return CheckpointStore(p.parent, clean=False), int(m.group(1))


def ls(root: str | os.PathLike) -> tuple[list[dict], Table]:
    """Checkpoints under `root`, oldest first: step, path, whether `latest` points at it, size, tensors."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory")
    store = CheckpointStore(root, clean=False)
    latest = store.latest_step()
    rows = []
    for step in store.steps():
        path = store.path_for(step)
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        try:
            body = read_manifest(path / manifest_name(0))
            tensors, world, status = len(body["tensors"]), body["world_size"], "ok"
        except CorruptCheckpoint as exc:
            tensors, world, status = None, None, f"damaged: {exc}"
        if latest is not None and step > latest:  # see CheckpointStore.steps_by_preference
            status += " (past latest: left by a run that resumed from an older step)"
        rows.append(
            {
                "step": step,
                "path": str(path),
                "latest": step == latest,
                "bytes": size,
                "tensors": tensors,
                "world_size": world,
                "status": status,
            }
        )
    table = Table(title=f"checkpoints in {root}")
    for col in ("step", "latest", "MB on disk", "tensors", "ranks", "manifest"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            str(r["step"]),
            "*" if r["latest"] else "",
            f"{r['bytes'] / 1e6:.3f}",
            str(r["tensors"]),
            str(r["world_size"]),
            r["status"],
        )
    return rows, table


def verify(path: str | os.PathLike) -> tuple[dict, Text]:
    """Fully decode and check a step directory, every step under a store root, or a compressed file."""
    p = Path(path)
    if p.is_file():
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            try:
                safetensors_codec.decompress_file(p, Path(tmp) / "check.safetensors")
                problems = {}
            except (CorruptCheckpoint, ValueError) as exc:
                problems = {p.name: [str(exc)]}
    elif _STEP_DIR.match(p.name):
        store, step = _locate(p)
        problems = {p.name: store.verify(step)}
    else:
        store = CheckpointStore(p, clean=False)
        problems = {store.path_for(s).name: store.verify(s) for s in store.steps()}
    problems = {k: v for k, v in problems.items() if v}
    data = {"path": str(p), "ok": not problems, "problems": problems}
    text = (
        Text(f"{p}: intact", style="green")
        if data["ok"]
        else Text(f"{p}: DAMAGED\n" + "\n".join(f"  {k}: {'; '.join(v)}" for k, v in problems.items()), style="red")
    )
    return data, text


def inspect(path: str | os.PathLike, rank: int = 0) -> tuple[dict, Table]:
    """One rank's manifest of a step directory: per tensor dtype, shape, codec, stored bytes, source file."""
    store, step = _locate(path)
    body = read_manifest(store.path_for(step) / manifest_name(rank))
    own = store.path_for(step).name
    table = Table(title=f"{path} rank {rank}: step {body['step']}, fingerprint {body.get('config_fingerprint')}")
    for col in ("tensor", "dtype", "shape", "codec", "stored KB", "stored in", "delta"):
        table.add_column(col)
    own_file = f"{own}/{data_name(rank)}"
    for name, e in body["tensors"].items():
        src = e["file"].split("/", 1)[0]
        where = "this" if e["file"] == own_file else (f"this, {e['file'].split('/', 1)[1]}" if src == own else src)
        table.add_row(
            name,
            e["dtype"],
            str(tuple(e["shape"])),
            e["codec"],
            f"{e['length'] / 1e3:.1f}",
            where,
            "yes" if e.get("delta_base") else "",
        )
    return body, table


def diff(a: str | os.PathLike, b: str | os.PathLike, rank: int = 0) -> tuple[dict, Table]:
    """Compare two step directories by tensor names, shapes, dtypes and content hashes."""
    sa, stepa = _locate(a)
    sb, stepb = _locate(b)
    ma = read_manifest(sa.path_for(stepa) / manifest_name(rank))
    mb = read_manifest(sb.path_for(stepb) / manifest_name(rank))
    ta, tb = ma["tensors"], mb["tensors"]
    result: dict[str, Any] = {
        "only_a": sorted(set(ta) - set(tb)),
        "only_b": sorted(set(tb) - set(ta)),
        "changed": [],
        "same": [],
        "reshaped": [],
        "fingerprint_a": ma.get("config_fingerprint"),
        "fingerprint_b": mb.get("config_fingerprint"),
    }
    for name in sorted(set(ta) & set(tb)):
        x, y = ta[name], tb[name]
        if (x["shape"], x["dtype"]) != (y["shape"], y["dtype"]):
            result["reshaped"].append(name)
        elif x["content_hash"] != y["content_hash"]:
            result["changed"].append(name)
        else:
            result["same"].append(name)
    table = Table(title=f"diff {a} -> {b}")
    table.add_column("what")
    table.add_column("count")
    table.add_column("examples")
    for key in ("only_a", "only_b", "reshaped", "changed", "same"):
        table.add_row(key, str(len(result[key])), ", ".join(result[key][:5]))
    if result["fingerprint_a"] != result["fingerprint_b"]:
        table.add_row("fingerprint", "differs", f"{result['fingerprint_a']} -> {result['fingerprint_b']}")
    return result, table


def _stats_table(stats: dict, title: str) -> Table:
    table = Table(title=title)
    table.add_column("field")
    table.add_column("value")
    for k, v in stats.items():
        table.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
    return table


def compress_file(src: str | os.PathLike, dst: str | os.PathLike) -> tuple[dict, Table]:
    stats = safetensors_codec.compress_file(src, dst)
    return stats, _stats_table(stats, "compress")


def decompress_file(src: str | os.PathLike, dst: str | os.PathLike) -> tuple[dict, Table]:
    stats = safetensors_codec.decompress_file(src, dst)
    return stats, _stats_table(stats, "decompress")


# ---- argparse wiring (islands.cli_more registers it) ------------------------------------------------
_VERBS = {
    "ls": ("checkpoints under a root, newest pointer marked", ["root"]),
    "verify": ("fully decode and check a step dir, a root, or a compressed file (exit 1 if damaged)", ["path"]),
    "inspect": ("one rank's manifest: tensors, dtypes, codec, stored bytes, dedup sources", ["step_dir"]),
    "diff": ("compare two step dirs by tensor names, shapes, dtypes and content hashes", ["a", "b"]),
    "compress": ("losslessly compress any safetensors file (islands codec)", ["src", "dst"]),
    "decompress": ("restore the byte-identical safetensors file", ["src", "dst"]),
}


def add_ckpt_command(sub, usage_error: type[Exception]) -> None:
    """`islands ckpt ls|verify|inspect|diff|compress|decompress`; bad input raises `usage_error` (exit 2)."""
    ck = sub.add_parser(
        "ckpt",
        help="inspect, verify, diff and compress checkpoints",
        description="Checkpoint tools (islands.checkpoint). Add --json for machine-readable output.",
    )
    verbs = ck.add_subparsers(dest="verb", required=True)
    for verb, (text, positionals) in _VERBS.items():
        p = verbs.add_parser(verb, help=text, description=text)
        for name in positionals:
            p.add_argument(name)
        if verb in ("inspect", "diff"):
            p.add_argument("--rank", type=int, default=0, help="which rank's part (default 0)")
        p.add_argument("--json", action="store_true", help="print the data as JSON instead of a table")
    ck.set_defaults(fn=lambda args: run_ckpt_command(args, usage_error))


def run_ckpt_command(args, usage_error: type[Exception] = ValueError) -> int:
    calls: dict[str, Callable[[], tuple[Any, Any]]] = {
        "ls": lambda: ls(args.root),
        "verify": lambda: verify(args.path),
        "inspect": lambda: inspect(args.step_dir, rank=args.rank),
        "diff": lambda: diff(args.a, args.b, rank=args.rank),
        "compress": lambda: compress_file(args.src, args.dst),
        "decompress": lambda: decompress_file(args.src, args.dst),
    }
    try:
        data, renderable = calls[args.verb]()
    except (ValueError, TypeError, FileNotFoundError, NotADirectoryError, NoCheckpoint, CheckpointMismatch) as e:
        raise usage_error(f"ckpt {args.verb}: {e}") from None
    except CorruptCheckpoint as e:
        Console(stderr=True).print(f"[red]ckpt {args.verb}: damaged: {e}[/]")
        return 1
    if args.json:
        print(json.dumps(data, indent=1, default=str))
    else:
        Console().print(renderable)
    return 1 if args.verb == "verify" and not data["ok"] else 0
