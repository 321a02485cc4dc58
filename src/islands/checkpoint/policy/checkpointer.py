"""`Checkpointer`: islands' checkpoints around a user's own training loop.

    ckpt = Checkpointer("runs/mine", world, every=100)     # async, multi-level, checksummed; RNG included
    start = ckpt.restore(model=model, optimizer=opt, strategy=strategy) or 0
    for step in range(start, steps):
        ...                                                 # one training step
        ckpt.maybe_save(step + 1, model=model, optimizer=opt, strategy=strategy)
    ckpt.close()                                            # or `with Checkpointer(...) as ckpt:`

What a checkpoint holds, per rank (each rank saves its own part of the same step; rank 0 commits):
- "model": `strategy.eval_model(model).state_dict()` when a strategy is given (for an outer strategy
  such as DiLoCo, the global model; its islands' live parameters and buffers are in the strategy's own
  state), else `model.state_dict()`;
- "optimizer": `islands.checkpoint.sharded_state.optimizer_state_dict` (torch's own form, or the full
  state keyed by parameter name when FSDP2 shards the model: any world size loads it);
- "strategy": `strategy.state_dict()`; "data": `data.state_dict()` (a sampler, one of islands'
  loaders, anything with state_dict/load_state_dict); "extra": the `extra` dict, each value through
  its state_dict() when it has one, else as it is (tensors, numbers, lists, dicts);
- "rng": torch's CPU generator, the current CUDA device's when CUDA is in use, python `random`, numpy
  (islands.checkpoint.policy.rng); "step" and "elapsed".
`restore` loads the newest checkpoint every rank can load (damaged ones are skipped, on every rank
alike), after checking it was made by the same model (names, shapes and dtypes of the model entry, and
the `fingerprint` string if one is given) and holds every part asked for; nothing is loaded when a
check fails. Several ranks: every rank calls every method, at the same steps (saves are collective).
Multi-level, intervals, the auto policy, asynchronous persist: islands.checkpoint.policy.driver.

Elastic jobs (`islands run --elastic`): a joiner's strategy wrap already received the members' global
model, strategy state and step (world.start_step), so its `restore` loads nothing from disk (an older
checkpoint would overwrite that state) and returns that step; it also meets nobody (the members are in
their loop). Before joiners enter, the members let the saves in flight finish (a new epoch would abandon
them): the Checkpointer registers that with the membership.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from islands.checkpoint.errors import CheckpointMismatch
from islands.checkpoint.policy.driver import CheckpointDriver
from islands.checkpoint.policy.resume import Source, candidates, resume_from
from islands.checkpoint.policy.rng import rng_state, set_rng_state
from islands.checkpoint.policy.settings import AutoInterval, CheckpointSettings
from islands.checkpoint.policy.sharded_state import load_optimizer_state_dict, optimizer_state_dict
from islands.data.loader import ShardSampler
from islands.runtime.compiled import uncompiled
from islands.runtime.world import World


def _shard_items(data) -> int:
    """Items in the data shard of islands' loaders and samplers (positions {"epoch", "cursor"}); -1 otherwise."""
    for obj in (data, getattr(data, "sampler", None)):
        if isinstance(obj, ShardSampler):
            return int(obj.n)
    return -1


class LoopState:
    """A TrainingState (islands.checkpoint.policy.driver) made of a user's objects at one step."""

    def __init__(
        self,
        world: World,
        step: int,
        elapsed: float,
        model: torch.nn.Module,
        optimizer=None,
        strategy=None,
        data=None,
        extra: dict | None = None,
    ):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model= takes the torch.nn.Module being trained; got {type(model).__name__}")
        if extra is not None and not isinstance(extra, dict):
            raise TypeError(
                f"extra= takes a dict of more state ({{'scheduler': sched, ...}}); got {type(extra).__name__}"
            )
        for name, obj, needs in (
            ("optimizer", optimizer, ("state_dict", "load_state_dict")),
            ("strategy", strategy, ("state_dict", "load_state_dict", "eval_model")),
            ("data", data, ("state_dict", "load_state_dict")),
        ):
            missing = [m for m in needs if obj is not None and not callable(getattr(obj, m, None))]
            if missing:
                raise TypeError(f"{name}= needs {', '.join(needs)}; {type(obj).__name__} has no {', '.join(missing)}")
        self.world, self.step, self.elapsed = world, step, elapsed
        self.model, self.optimizer, self.strategy, self.data, self.extra = model, optimizer, strategy, data, extra

    @property
    def shard_items(self) -> int:
        return _shard_items(self.data) if self.data is not None else -1

    def _checkpointed_model(self) -> torch.nn.Module:
        # under any torch.compile wrapper: the keys of an eager run, so either run resumes from the other's checkpoints
        return uncompiled(self.strategy.eval_model(self.model) if self.strategy is not None else self.model)

    def model_state_dict(self) -> dict:
        return self._checkpointed_model().state_dict()

    def _parts(self) -> dict:
        return {
            name: obj
            for name, obj in (
                ("optimizer", self.optimizer),
                ("strategy", self.strategy),
                ("data", self.data),
                ("extra", self.extra),
            )
            if obj is not None
        }

    def state_dict(self) -> dict:
        tree = {"step": self.step, "elapsed": self.elapsed, "model": self.model_state_dict(), "rng": rng_state()}
        for name, obj in self._parts().items():
            if name == "optimizer":
                tree[name] = optimizer_state_dict(self.model, obj, self.world)  # collective under FSDP2
            elif name == "extra":
                tree[name] = {
                    k: v.state_dict() if callable(getattr(v, "state_dict", None)) else v for k, v in obj.items()
                }
            else:
                tree[name] = obj.state_dict()
        return tree

    def load_state_dict(self, tree: dict) -> None:
        # everything asked for must be there before anything is loaded: never a half-restored state
        missing = [f"{name!r} (the checkpoint was saved without {name}=)" for name in self._parts() if name not in tree]
        missing += [
            f"extra[{k!r}] (not in the checkpoint's extra)"
            for k in (self.extra or {})
            if "extra" in tree and k not in tree["extra"]
        ]
        if missing:
            raise CheckpointMismatch([f"the checkpoint of step {tree.get('step')} has no {m}" for m in missing])
        self._checkpointed_model().load_state_dict(tree["model"])
        if self.optimizer is not None:
            load_optimizer_state_dict(self.model, self.optimizer, tree["optimizer"])
        if self.strategy is not None:
            self.strategy.load_state_dict(tree["strategy"])
        if self.data is not None:
            self.data.load_state_dict(tree["data"])
        extra = self.extra or {}
        for k, v in extra.items():
            if callable(getattr(v, "load_state_dict", None)):
                v.load_state_dict(tree["extra"][k])
            else:
                extra[k] = tree["extra"][k]
        set_rng_state(tree["rng"])
        self.step, self.elapsed = int(tree["step"]), float(tree.get("elapsed", 0.0))


class Checkpointer:
    """Checkpoints of a user's own loop (module docstring). Options are CheckpointSettings' (driver.py):

    dir           the local-disk level's root
    world         the job's World (islands.init_world()); None = a single process
    every         steps between local-disk checkpoints (0 = none; policy= chooses instead)
    policy        None or AutoInterval(...): the interval from the overhead bound and failure rate
    memory_every, memory_peer, remote_dir, remote_every, keep, asynchronous, share_replicas, timeout
    fingerprint   an opaque string saved with every checkpoint; restore refuses one saved with another
    """

    def __init__(
        self,
        dir: str | Path,
        world: World | None = None,
        *,
        every: int = 0,
        policy: AutoInterval | None = None,
        memory_every: int = 0,
        memory_peer: bool = False,
        remote_dir: str | Path | None = None,
        remote_every: int = 0,
        keep: int = 3,
        asynchronous: bool = True,
        share_replicas: bool = True,
        timeout: float = 120.0,
        fingerprint: str = "",
    ):
        if not dir:
            raise ValueError(
                "Checkpointer needs a directory for its checkpoints, e.g. Checkpointer('runs/mine', world, every=100)"
            )
        if world is None:
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                raise ValueError(
                    f"this process is rank {dist.get_rank()} of {dist.get_world_size()}: pass "
                    "world=islands.init_world() so every rank saves its own part (world=None is "
                    "for a single process)"
                )
            world = World.single()
        self.world = world
        self.settings = CheckpointSettings(
            dir=dir,
            every=every,
            policy=policy,
            memory_every=memory_every,
            memory_peer=memory_peer,
            remote_dir=remote_dir,
            remote_every=remote_every,
            keep=keep,
            asynchronous=asynchronous,
            share_replicas=share_replicas,
            timeout=timeout,
        )
        if not self.settings.enabled:
            raise ValueError(
                "Checkpointer needs an interval: every=N steps, policy=AutoInterval(), memory_every=N "
                "or remote_dir= with remote_every=N"
            )
        self.fingerprint = fingerprint
        self.driver = CheckpointDriver(self.settings, world, fingerprint=fingerprint)
        self.restored: dict | None = None  # what restore() loaded: path, level, step, world sizes, skipped
        self._elapsed_at_mark, self._mark = 0.0, time.perf_counter()
        self._last: LoopState | None = None  # the state of the last maybe_save (elastic: settled before a join)
        if world.membership is not None:
            world.membership.before_join.append(self._settle)

    def _settle(self) -> None:
        """Elastic, before joiners enter: what is due at the last step is saved and nothing is in flight."""
        if self._last is not None:
            self.driver.settle(self._last)
        else:
            self.driver.wait()

    def _elapsed(self) -> float:
        return self._elapsed_at_mark + time.perf_counter() - self._mark

    def _state(self, step: int, parts: dict) -> LoopState:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step is the number of optimizer steps done, an int >= 0; got {step!r}")
        return LoopState(self.world, step, self._elapsed(), **parts)

    def restore(
        self, *, model: torch.nn.Module, optimizer=None, strategy=None, data=None, extra: dict | None = None
    ) -> int | None:
        """Load the newest checkpoint into these objects; returns its step, or None when there is none.
        A joiner of an elastic job loads nothing and returns world.start_step (module docstring).

        Raises CheckpointMismatch (a ValueError) naming each difference when the checkpoint was made by
        another model or lacks a part asked for, NoCheckpoint when checkpoints exist but none is intact
        on every rank. Give the objects as they will be trained: after `strategy.wrap`.
        """
        state = self._state(0, dict(model=model, optimizer=optimizer, strategy=strategy, data=data, extra=extra))
        if self.world.start_step:  # an elastic joiner: it holds the members' state of that step already
            self.driver.resumed(self.world.start_step)
            self.restored = {"step": self.world.start_step, "joined": True}
            return self.world.start_step
        sources = [Source("local", self.driver.root, None)]
        if self.driver.remote_root is not None:
            sources.append(Source("remote", self.driver.remote_root, None))
        found = bool(candidates(sources))
        if self.world.size > 1:
            everywhere = self.world.all_gather_object(found)
            if any(everywhere) and not all(everywhere):
                raise RuntimeError(
                    f"ranks {[r for r, f in enumerate(everywhere) if not f]} see no checkpoint under "
                    f"{[str(s.root) for s in sources]} while others do: every rank needs the same "
                    "directory (a shared filesystem)"
                )
        if not found:
            return None
        info = resume_from(state, sources, self.fingerprint)
        self.driver.resumed(info["step"], info)
        self.restored = info
        self._elapsed_at_mark, self._mark = state.elapsed, time.perf_counter()
        return info["step"]

    def maybe_save(
        self, step: int, *, model: torch.nn.Module, optimizer=None, strategy=None, data=None, extra: dict | None = None
    ) -> bool:
        """After `step` optimizer steps: save the levels due at this step (returns True when it saved).
        An asynchronous save returns once the state is copied; it is durable by close()."""
        state = self._state(step, dict(model=model, optimizer=optimizer, strategy=strategy, data=data, extra=extra))
        self._last = state
        return self.driver.after_step(state) is not None

    def save(
        self, step: int, *, model: torch.nn.Module, optimizer=None, strategy=None, data=None, extra: dict | None = None
    ) -> bool:
        """Save `step` to the disk levels now, whatever the interval (e.g. the last step); False when
        that step is already saved there."""
        state = self._state(step, dict(model=model, optimizer=optimizer, strategy=strategy, data=data, extra=extra))
        return self.driver.save_now(state) is not None

    def record(self) -> dict:
        """Saves per level, stall and persist seconds, interval decisions, where a restore came from."""
        return self.driver.record()

    def close(self) -> None:
        """Wait until every save is durable; raises if one failed. Saves nothing itself."""
        self.driver.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
