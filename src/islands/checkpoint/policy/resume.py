"""Exact resume: put a training state back where a checkpoint left it.

`resume(state, path, remote_dir=None, fingerprint="")` loads into a TrainingState (islands.checkpoint
.driver: world, model_state_dict(), shard_items, load_state_dict). `path` may be a run directory (its
ckpt/), a checkpoint root (newest intact step, falling back past damaged ones; `remote_dir`, the
remote level, is a second source) or one step directory (that step only). All ranks load the same
step: each tries its part, they agree, and a step some rank cannot load is skipped by all.
`check_resume(path, fingerprint)` is the check before any worker starts.

Same world size: rank r loads rank r's part, so model, optimizer, strategy state, RNG, data position
and step continue bitwise as if never interrupted.

Different world size (N saved ranks -> M ranks), stated policy:
- supported only when model, optimizer and strategy state are replicated, i.e. identical (by content
  hash and skeleton) on every saved rank, as with ddp, outer strategies whose state is global, and
  fsdp (whose optimizer shards are stored gathered, islands.checkpoint.policy.sharded_state); per-rank state
  (error feedback, per-island outer state) is refused naming the first key that differs;
- new rank r takes those parts, its RNG state and any other entry from saved rank r mod N (RNG
  continuity per rank is not preserved; the ddp step draws no per-rank random numbers);
- data positions: shard boundaries move, so exact positions cannot carry over. A position of the form
  {"epoch", "cursor"} (islands' loaders and samplers) starts every new rank at the mean epoch progress
  of the saved ranks (epoch + cursor / shard size), scaled to its own shard: no sample is guaranteed
  to be seen exactly once across the switch. Any other form is saved rank r mod N's, as it is;
- step, elapsed time and the loss series come from saved rank 0.

Elastic jobs match parts by data shard instead of rank (see _load_elastic).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

from islands.checkpoint.errors import CheckpointMismatch, CorruptCheckpoint, NoCheckpoint
from islands.checkpoint.policy.fingerprint import fingerprint_differences
from islands.checkpoint.store.directory import _STEP_DIR, LATEST, CheckpointStore
from islands.checkpoint.store.manifest import compare_with, manifest_name, read_manifest

REPLICATED = ("model", "optimizer", "strategy")
DATA_KEYS = ("data", "loader")  # the data position's entry; "loader" in checkpoints of islands <= session 9
FROM_RANK_0 = ("step", "elapsed", "series")
LOADER_POLICY = "mean epoch progress of the saved ranks, scaled to this rank's shard"


@dataclass
class Source:
    name: str
    root: Path
    step: int | None  # None = newest intact


def resolve(path: str | Path) -> Source:
    """A run dir, a checkpoint root or a step dir -> where to load from."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(
            f"resume path {str(p)!r} is not a directory; give a run directory, a checkpoint "
            "directory (holding step-* directories) or one step directory"
        )
    m = _STEP_DIR.match(p.name)
    if m:
        return Source("local", p.parent, int(m.group(1)))
    for root in (p, p / "ckpt"):
        if (root / LATEST).exists() or any(_STEP_DIR.match(e.name) for e in root.iterdir() if e.is_dir()):
            return Source("local", root, None)
        if not (p / "ckpt").is_dir():
            break
    raise ValueError(f"no checkpoint under {str(p)!r}: expected step-* directories there or in {str(p / 'ckpt')!r}")


def candidates(sources: list[Source]) -> list[tuple[int, int, Source, CheckpointStore]]:
    """(step, source order, source, store) for every committed step, in the order a resume tries them."""
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


def check_resume(path: str | Path, fingerprint: str = "") -> None:
    """Before any worker starts: a checkpoint exists under `path` and was made with `fingerprint`.

    Raises ValueError naming every differing field (a CLI turns it into exit code 2).
    """
    src = resolve(path)
    cands = candidates([src])
    if not cands:
        raise ValueError(f"resume: no checkpoint directories under {str(src.root)!r}")
    step, _, _, store = cands[0]
    try:
        body = read_manifest(store.path_for(step) / manifest_name(0))
    except CorruptCheckpoint:
        return  # damaged newest: the workers fall back to an older one (and check that one)
    diffs = fingerprint_differences(body.get("config_fingerprint"), fingerprint)
    if diffs:
        raise ValueError(
            f"resume: checkpoint {store.path_for(step)} was made by another model config: " + "; ".join(diffs)
        )


def _manifests(store: CheckpointStore, step: int) -> list[dict]:
    first = read_manifest(store.path_for(step) / manifest_name(0))
    return [first] + [read_manifest(store.path_for(step) / manifest_name(r)) for r in range(1, first["world_size"])]


def _check_replicated(bodies: list[dict], new_size: int) -> None:
    ref = bodies[0]
    for body in bodies[1:]:
        for part in REPLICATED:
            if json.dumps(ref["skeleton"].get(part), sort_keys=True) != json.dumps(
                body["skeleton"].get(part), sort_keys=True
            ):
                raise CheckpointMismatch(
                    [
                        f"cannot load a checkpoint of {len(bodies)} ranks into {new_size}: "
                        f"{part!r} structure differs between saved ranks 0 and {body['rank']} "
                        "(per-rank state cannot be resharded)"
                    ]
                )
        for name, entry in ref["tensors"].items():
            if name.split("/", 1)[0] not in REPLICATED:
                continue
            other = body["tensors"].get(name)
            if other is None or other["content_hash"] != entry["content_hash"]:
                raise CheckpointMismatch(
                    [
                        f"cannot load a checkpoint of {len(bodies)} ranks into {new_size}: "
                        f"{name!r} differs between saved ranks 0 and {body['rank']} (per-rank "
                        "state such as error feedback cannot be resharded)"
                    ]
                )


def _is_position(pos: object) -> TypeGuard[dict]:
    return isinstance(pos, dict) and set(pos) == {"epoch", "cursor"}


def reshard_position(trees: list[dict], key: str, own_items: int, fallback):
    """Mean epoch progress of the saved ranks, placed on a shard of `own_items` (module docstring);
    `fallback` (saved rank r mod N's entry) when positions are of another form or a size is unknown."""
    progress = []
    for t in trees:
        items, pos = t.get("world", {}).get("shard_items", -1), t.get(key)
        if not _is_position(pos) or items is None or items < 1 or own_items < 1:
            return fallback
        progress.append(pos["epoch"] + pos["cursor"] / items)
    mean = sum(progress) / len(progress)
    epoch = math.floor(mean)
    cursor = int(round((mean - epoch) * own_items))  # noqa: RUF046 - saved positions may be tensors: round() keeps them
    return {"epoch": epoch, "cursor": min(cursor, own_items - 1)}


def _reshard_data(state, trees: list[dict], tree: dict, info: dict) -> None:
    """Replace `tree`'s data position by the resharded one (in place); say so in `info`."""
    for key in DATA_KEYS:
        if key in tree:
            kept = tree[key]
            tree[key] = reshard_position(trees, key, int(state.shard_items), kept)
            as_saved = "saved rank r mod N's data position, as it was"
            info["data_policy"] = as_saved if tree[key] is kept else LOADER_POLICY


def _load_tree(store: CheckpointStore, step: int, rank: int) -> dict:
    tree = store.load(step, rank=rank).tree
    assert isinstance(tree, dict)  # the driver saves dicts (CheckpointDriver.tree)
    return tree


def _load_for_rank(state, store: CheckpointStore, step: int, fingerprint: str) -> tuple[dict, dict]:
    world = state.world
    bodies = _manifests(store, step)
    for body in bodies:
        diffs = fingerprint_differences(body.get("config_fingerprint"), fingerprint)
        if diffs:
            raise CheckpointMismatch(
                [f"checkpoint {store.path_for(step)} was made by another model config: " + "; ".join(diffs)]
            )
    model_body = {**bodies[0], "tensors": {k: v for k, v in bodies[0]["tensors"].items() if k.startswith("model/")}}
    if diffs := compare_with(model_body, {"model": state.model_state_dict()}):
        raise CheckpointMismatch([f"checkpoint {store.path_for(step)} holds another model:"] + diffs)
    saved = len(bodies)
    info = {"saved_world_size": saved, "world_size": world.size, "resharded": saved != world.size}
    if world.membership is not None:
        return _load_elastic(state, store, step, bodies, info)
    if saved == world.size:
        return _load_tree(store, step, world.rank), info
    _check_replicated(bodies, world.size)
    trees = [_load_tree(store, step, r) for r in range(saved)]
    tree = dict(trees[world.rank % saved])
    for key in FROM_RANK_0:
        if key in trees[0]:
            tree[key] = trees[0][key]
    _reshard_data(state, trees, tree, info)
    return tree, info


def _saved_shard(body: dict) -> int | None:
    world = body.get("skeleton", {}).get("world")
    return world.get("shard") if isinstance(world, dict) else None


def _load_elastic(state, store: CheckpointStore, step: int, bodies: list[dict], info: dict) -> tuple[dict, dict]:
    """Elastic job: a worker takes the saved part of its own data shard (exact), else of rank r mod N.

    Ranks follow admission order, which differs between runs, so parts are matched by data shard.
    Without a saved part for its shard (more workers than were saved), a worker starts from saved
    rank r mod N's local model and inner optimizer, with the data position resharded as above.
    The global parts -- outer-strategy state, step, membership history -- come from saved rank 0:
    members agree on the outer state bit for bit after every synchronisation.
    """
    world = state.world
    own = int((world.data_shard or (world.rank, world.size))[0])
    shards = [_saved_shard(b) for b in bodies]
    match = shards.index(own) if own in shards else None
    part = match if match is not None else world.rank % len(bodies)
    tree = dict(_load_tree(store, step, part))
    first = tree if part == 0 else _load_tree(store, step, 0)
    for key in FROM_RANK_0 + ("membership",):
        if key in first:
            tree[key] = first[key]
    if match is None:
        trees = [_load_tree(store, step, r) for r in range(len(bodies))]
        _reshard_data(state, trees, tree, info)
    info.update(elastic=True, shard=own, saved_part=part, shard_matched=match is not None)
    return tree, info


def resume_from(state, sources: list[Source], fingerprint: str = "") -> dict:
    """Load the newest checkpoint of `sources` that every rank can load into `state`; returns what was
    loaded (path, level, step, world sizes, what was skipped). Raises NoCheckpoint when none loads
    everywhere, CheckpointMismatch when one was made by another model (no fallback past it)."""
    world = state.world
    skipped: list[dict] = []
    for step, _, src, store in candidates(sources):
        tree: dict | None = None
        info: dict | None = None
        error: str | None = None
        try:
            tree, info = _load_for_rank(state, store, step, fingerprint)
        except (CorruptCheckpoint, NoCheckpoint) as exc:
            error = str(exc)
        oks = world.all_gather_object(error is None) if world.size > 1 else [error is None]
        if all(oks):
            assert tree is not None and info is not None  # this rank's own load raised nothing
            state.load_state_dict(tree)
            return {"path": str(store.path_for(step)), "level": src.name, "step": step, **info, "skipped": skipped}
        bad = [r for r, ok in enumerate(oks) if not ok]
        skipped.append({"path": str(store.path_for(step)), "ranks_failed": bad, "why": error or "another rank failed"})
    raise NoCheckpoint(
        f"resume: no checkpoint under {[str(s.root) for s in sources]} loads on every rank: "
        + ("; ".join(f"{s['path']}: {s['why']}" for s in skipped) or "none found")
    )


def resume(state, path: str | Path, remote_dir: str | Path | None = None, fingerprint: str = "") -> dict:
    """Load the newest checkpoint under `path` (and `remote_dir`, unless `path` names one step) that every
    rank can load into `state` (a TrainingState); returns what was loaded. A checkpoint driver of the
    same job is told with `driver.resumed(info["step"], info)`."""
    sources = [resolve(path)]
    if remote_dir and sources[0].step is None:
        sources.append(Source("remote", Path(remote_dir), None))
    return resume_from(state, sources, fingerprint)
