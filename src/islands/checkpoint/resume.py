"""Exact resume: put a trainer back where a checkpoint left it (`islands train --resume DIR`).

DIR may be a run directory (its ckpt/), a checkpoint root (newest intact step, falling back past
damaged ones; the remote level ckpt_remote_dir is a second source) or one step directory (that step
only). All ranks load the same step: each tries its part, they agree, and a step some rank cannot
load is skipped by all.

Same world size: rank r loads rank r's part, so model, optimizer, strategy state, RNG, loader position
and step continue bitwise as if never interrupted.

Different world size (N saved ranks -> M ranks), stated policy:
- supported only when model, optimizer and strategy state are replicated, i.e. identical (by content
  hash and skeleton) on every saved rank, as with ddp, outer strategies whose state is global, and
  fsdp (whose optimizer shards are stored gathered, islands.checkpoint.sharded_state); per-rank state
  (error feedback, per-island outer state) is refused naming the first key that differs;
- new rank r takes those parts and its RNG state from saved rank r mod N (RNG continuity per rank is
  not preserved; the ddp step draws no per-rank random numbers);
- loader positions: shard boundaries move, so exact positions cannot carry over. Every new rank
  starts at the mean epoch progress of the saved ranks (epoch + cursor / shard size), scaled to its
  own shard: no sample is guaranteed to be seen exactly once across the switch;
- step, elapsed time and the loss series come from saved rank 0.

Elastic jobs match parts by data shard instead of rank (see _load_elastic).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from islands.checkpoint.errors import CheckpointMismatch, CorruptCheckpoint, NoCheckpoint
from islands.checkpoint.manifest import compare_with, manifest_name, read_manifest
from islands.checkpoint.store import _STEP_DIR, LATEST, CheckpointStore

REPLICATED = ("model", "optimizer", "strategy")


@dataclass
class Source:
    name: str
    root: Path
    step: int | None  # None = newest intact


def resolve(path: str | Path) -> Source:
    """A run dir, a checkpoint root or a step dir -> where to load from."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"resume path {str(p)!r} is not a directory; give a run directory, a checkpoint "
                         "directory (holding step-* directories) or one step directory")
    m = _STEP_DIR.match(p.name)
    if m:
        return Source("local", p.parent, int(m.group(1)))
    for root in (p, p / "ckpt"):
        if (root / LATEST).exists() or any(_STEP_DIR.match(e.name) for e in root.iterdir() if e.is_dir()):
            return Source("local", root, None)
        if not (p / "ckpt").is_dir():
            break
    raise ValueError(f"no checkpoint under {str(p)!r}: expected step-* directories there or in {str(p / 'ckpt')!r}")


def _fields(fp: str | None) -> dict:
    try:
        out = json.loads(fp) if fp else {}
    except ValueError:
        return {"<fingerprint>": fp}
    return out if isinstance(out, dict) else {"<fingerprint>": fp}


def fingerprint_differences(stored: str | None, current: str) -> list[str]:
    """Field by field: 'd_model: checkpoint 64, current 128'."""
    a, b = _fields(stored), _fields(current)
    return [f"{k}: checkpoint {a.get(k, '<absent>')!r}, current {b.get(k, '<absent>')!r}"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def _candidates(sources: list[Source]) -> list[tuple[int, int, Source, CheckpointStore]]:
    found = []
    for order, src in enumerate(sources):
        if not src.root.is_dir():
            continue
        store = CheckpointStore(src.root, clean=False)
        steps = [src.step] if src.step is not None else store.steps()
        latest = store.latest_step()
        found += [(step, order, src, store, latest is not None and step > latest) for step in steps]
    # newest first, but steps past their root's `latest` (an abandoned timeline) after every other
    found.sort(key=lambda c: (c[4], -c[0], c[1]))
    return [c[:4] for c in found]


def check_resume(cfg) -> None:
    """Before any worker starts: the checkpoint exists and was made by the same model config.

    Raises ValueError naming every differing field (the CLI turns it into exit code 2).
    """
    from islands.checkpoint.driver import config_fingerprint

    src = resolve(cfg.resume)
    cands = _candidates([src])
    if not cands:
        raise ValueError(f"resume: no checkpoint directories under {str(src.root)!r}")
    step, _, _, store = cands[0]
    try:
        body = read_manifest(store.path_for(step) / manifest_name(0))
    except CorruptCheckpoint:
        return  # damaged newest: the workers fall back to an older one (and check that one)
    diffs = fingerprint_differences(body.get("config_fingerprint"), config_fingerprint(cfg))
    if diffs:
        raise ValueError(f"resume: checkpoint {store.path_for(step)} was made by another model config: "
                         + "; ".join(diffs))


def _manifests(store: CheckpointStore, step: int) -> list[dict]:
    first = read_manifest(store.path_for(step) / manifest_name(0))
    return [first] + [read_manifest(store.path_for(step) / manifest_name(r)) for r in range(1, first["world_size"])]


def _check_replicated(bodies: list[dict], new_size: int) -> None:
    ref = bodies[0]
    for body in bodies[1:]:
        for part in REPLICATED:
            if json.dumps(ref["skeleton"].get(part), sort_keys=True) != json.dumps(body["skeleton"].get(part),
                                                                                   sort_keys=True):
                raise CheckpointMismatch([f"cannot load a checkpoint of {len(bodies)} ranks into {new_size}: "
                                          f"{part!r} structure differs between saved ranks 0 and {body['rank']} "
                                          "(per-rank state cannot be resharded)"])
        for name, entry in ref["tensors"].items():
            if name.split("/", 1)[0] not in REPLICATED:
                continue
            other = body["tensors"].get(name)
            if other is None or other["content_hash"] != entry["content_hash"]:
                raise CheckpointMismatch([f"cannot load a checkpoint of {len(bodies)} ranks into {new_size}: "
                                          f"{name!r} differs between saved ranks 0 and {body['rank']} (per-rank "
                                          "state such as error feedback cannot be resharded)"])


def _reshard_loader(trainer, trees: list[dict]) -> dict:
    """Mean epoch progress of the saved ranks, placed on this rank's own shard (module docstring)."""
    progress = []
    for t in trees:
        items, pos = t.get("world", {}).get("shard_items", -1), t["loader"]
        if items is None or items < 1:
            return dict(trees[0]["loader"])
        progress.append(pos["epoch"] + pos["cursor"] / items)
    mean = sum(progress) / len(progress)
    own = trainer.task.loader.sampler.n
    epoch = math.floor(mean)
    return {"epoch": epoch, "cursor": min(int(round((mean - epoch) * own)), own - 1)}


def _load_for_rank(trainer, store: CheckpointStore, step: int, fingerprint: str) -> tuple[dict, dict]:
    world = trainer.world
    bodies = _manifests(store, step)
    diffs = fingerprint_differences(bodies[0].get("config_fingerprint"), fingerprint)
    if diffs:
        raise CheckpointMismatch([f"checkpoint {store.path_for(step)} was made by another model config: "
                                  + "; ".join(diffs)])
    model_like = {"model": trainer.strategy.eval_model(trainer.model).state_dict()}
    model_body = {**bodies[0], "tensors": {k: v for k, v in bodies[0]["tensors"].items() if k.startswith("model/")}}
    if diffs := compare_with(model_body, model_like):
        raise CheckpointMismatch(diffs)
    saved = len(bodies)
    info = {"saved_world_size": saved, "world_size": world.size, "resharded": saved != world.size}
    if getattr(world, "membership", None) is not None:
        return _load_elastic(trainer, store, step, bodies, fingerprint, info)
    if saved == world.size:
        return store.load(step, rank=world.rank, fingerprint=fingerprint).tree, info
    _check_replicated(bodies, world.size)
    trees = [store.load(step, rank=r, fingerprint=fingerprint).tree for r in range(saved)]
    tree = dict(trees[world.rank % saved])
    for key in ("step", "elapsed", "series"):
        if key in trees[0]:
            tree[key] = trees[0][key]
    tree["loader"] = _reshard_loader(trainer, trees)
    info["loader_policy"] = "mean epoch progress of the saved ranks, scaled to this rank's shard"
    return tree, info


def _saved_shard(body: dict) -> int | None:
    world = body.get("skeleton", {}).get("world")
    return world.get("shard") if isinstance(world, dict) else None


def _load_elastic(trainer, store: CheckpointStore, step: int, bodies: list[dict], fingerprint: str,
                  info: dict) -> tuple[dict, dict]:
    """Elastic job: a worker takes the saved part of its own data shard (exact), else of rank r mod N.

    Ranks follow admission order, which differs between runs, so parts are matched by data shard.
    Without a saved part for its shard (more workers than were saved), a worker starts from saved
    rank r mod N's local model and inner optimizer, with the loader at the saved ranks' mean progress.
    The global parts -- outer-strategy state, step, membership history -- come from saved rank 0:
    members agree on the outer state bit for bit after every synchronisation.
    """
    world = trainer.world
    own = int((world.data_shard or (world.rank, world.size))[0])
    shards = [_saved_shard(b) for b in bodies]
    match = shards.index(own) if own in shards else None
    part = match if match is not None else world.rank % len(bodies)
    tree = dict(store.load(step, rank=part, fingerprint=fingerprint).tree)
    first = tree if part == 0 else store.load(step, rank=0, fingerprint=fingerprint).tree
    for key in ("step", "elapsed", "series", "membership"):
        if key in first:
            tree[key] = first[key]
    if match is None:
        trees = [store.load(step, rank=r, fingerprint=fingerprint).tree for r in range(len(bodies))]
        tree["loader"] = _reshard_loader(trainer, trees)
        info["loader_policy"] = "mean epoch progress of the saved ranks, scaled to this rank's shard"
    info.update(elastic=True, shard=own, saved_part=part, shard_matched=match is not None)
    return tree, info


def resume_trainer(trainer, path: str | Path) -> dict:
    """Load the newest checkpoint every rank can load into `trainer`; returns what was loaded.

    Sets trainer.resumed_from (run.json records it) and tells the trainer's checkpoint driver.
    """
    from islands.checkpoint.driver import config_fingerprint

    world = trainer.world
    fingerprint = config_fingerprint(trainer.cfg)
    sources = [resolve(path)]
    if trainer.cfg.ckpt_remote_dir and sources[0].step is None:
        sources.append(Source("remote", Path(trainer.cfg.ckpt_remote_dir), None))
    skipped = []
    for step, _, src, store in _candidates(sources):
        tree, info, error = None, None, None
        try:
            tree, info = _load_for_rank(trainer, store, step, fingerprint)
        except (CorruptCheckpoint, NoCheckpoint) as exc:
            error = str(exc)
        except CheckpointMismatch:
            raise
        oks = world.all_gather_object(error is None) if world.size > 1 else [error is None]
        if all(oks):
            trainer.load_state_dict(tree)
            resumed = {"path": str(store.path_for(step)), "level": src.name, "step": step, **info,
                       "skipped": skipped}
            trainer.resumed_from = resumed
            if getattr(trainer, "checkpoints", None) is not None:
                trainer.checkpoints.resumed(step)
            return resumed
        bad = [r for r, ok in enumerate(oks) if not ok]
        skipped.append({"path": str(store.path_for(step)), "ranks_failed": bad, "why": error or "another rank failed"})
    raise NoCheckpoint(f"resume: no checkpoint under {[str(s.root) for s in sources]} loads on every rank: "
                       + ("; ".join(f"{s['path']}: {s['why']}" for s in skipped) or "none found"))
