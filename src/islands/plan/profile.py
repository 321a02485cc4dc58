"""One worker's step as the Trainer runs it, profiled once on the device and cached; and the extra local work of an
outer strategy's round (its outer step, its compressor on the model's own flat parameter vector, its bookkeeping).

The step is the Trainer's own (islands.loop: lr schedule, strategy.on_batch, forward and backward with the job's
micro-batches and precision, clipping, optimizer step, zero_grad, the loss readout), timed by the Trainer's own
clock (the per-step wall times its loop keeps, whose sum is a run's seconds per step), after warm-up steps, on one
worker with no other rank (World.single). Forward and optimizer times come from hooks on the model and the
optimizer; backward is the rest. The cache key is the model's fingerprint (class, parameter names, shapes and
dtypes, the batch's shapes), the device, the torch version and the step's settings: the same job on the same
machine is profiled once; `refresh=True` measures again.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from islands.data.batches import size as batch_size, to_device
from islands.loop.trainer import Trainer
from islands.memory.accounting import SavedTensorMeter, state_bytes
from islands.sync.outer.diloco import DiLoCo
from islands.sync.outer.rounds import overlap_steps

CACHE_ENV = "ISLANDS_PLAN_CACHE"
MIN_PROFILE_S = 2.0  # a fast model's profile runs this long (or MAX_PROFILE_STEPS), beyond its minimum of steps
MAX_PROFILE_STEPS = 400
ROUND_CYCLES = 6  # rounds timed per outer strategy (after one of warm-up); their median is kept


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "islands" / "plan"))


@dataclass(frozen=True)
class Profile:
    """One worker's measured step at `batch_size` samples on `device`."""

    fingerprint: str
    device: str
    batch_size: int
    forward_s: float
    backward_s: float  # the step less forward and optimizer: backward, data, clipping, the loop's own work
    optimizer_s: float
    step_s: float  # the Trainer's whole step (median)
    spread: float  # (second largest - second smallest) / median of the whole step over the measured steps
    activation_peak_bytes: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    buffer_bytes: int  # floating buffers (what an outer strategy averages beside the parameters)
    param_numels: list[int] = field(default_factory=list)
    step_samples: list[float] = field(default_factory=list)  # every measured whole step, seconds
    modules_s: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    cached: bool = False

    @property
    def numel(self) -> int:
        return sum(self.param_numels)

    @property
    def compute_s(self) -> float:
        """The mean step (a run's seconds per step is a mean: wall time over steps)."""
        return statistics.fmean(self.step_samples) if self.step_samples else self.step_s

    def straggler_s(self, n: int, steps: int = 1) -> float:
        """Expected wait at a collective that n workers enter after `steps` steps each: E[max of n] - mean, for steps
        drawn from the measured ones (exact over the empirical distribution; a sum of `steps` draws scales the
        spread by sqrt(steps), as for independent steps)."""
        xs = sorted(self.step_samples)
        m = len(xs)
        if n < 2 or m < 2:
            return 0.0
        e_max = sum(x * ((i / m) ** n - ((i - 1) / m) ** n) for i, x in enumerate(xs, 1))
        return (e_max - statistics.fmean(xs)) * math.sqrt(steps)


def fingerprint(model: torch.nn.Module, batch, extra: str = "") -> str:
    h = hashlib.sha256()
    h.update(type(model).__qualname__.encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}".encode())
    for name, b in model.named_buffers():
        h.update(f"b{name}:{tuple(b.shape)}:{b.dtype}".encode())
    leaves = batch if isinstance(batch, (list, tuple)) else [batch]
    for t in leaves:
        h.update(f"x{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}".encode())
    h.update(f"{torch.__version__}:{extra}".encode())
    return h.hexdigest()[:16]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _ModuleClock:
    """Forward time of each top-level child (pre and post hooks), summed over a step."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device = device
        self.times: dict[str, list[float]] = {}
        self._start: dict[str, float] = {}
        self.handles = []
        for name, child in model.named_children():
            self.handles.append(child.register_forward_pre_hook(self._pre(name)))
            self.handles.append(child.register_forward_hook(self._post(name)))

    def _pre(self, name):
        def hook(_m, _args):
            _sync(self.device)
            self._start[name] = time.perf_counter()

        return hook

    def _post(self, name):
        def hook(_m, _args, _out):
            _sync(self.device)
            self.times.setdefault(name, []).append(time.perf_counter() - self._start[name])

        return hook

    def per_step(self, steps: int) -> dict[str, float]:
        return {n: sum(v) / steps for n, v in self.times.items()}

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class _SplitClock:
    """Per step: the forward time (the model's pre and post hooks, summed over micro-batches) and the optimizer's
    step time (its pre and post hooks); a step ends at the optimizer's post hook, once per Trainer step."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
        self.device = device
        self.forward: list[float] = []
        self.optimizer: list[float] = []
        self._fwd, self._t = 0.0, 0.0
        self.handles = [
            model.register_forward_pre_hook(lambda *_: self._start()),
            model.register_forward_hook(lambda *_: self._forward_done()),
            optimizer.register_step_pre_hook(lambda *_: self._start()),
            optimizer.register_step_post_hook(lambda *_: self._optimizer_done()),
        ]

    def _start(self) -> None:
        _sync(self.device)
        self._t = time.perf_counter()

    def _forward_done(self) -> None:
        _sync(self.device)
        self._fwd += time.perf_counter() - self._t

    def _optimizer_done(self) -> None:
        _sync(self.device)
        self.optimizer.append(time.perf_counter() - self._t)
        self.forward.append(self._fwd)
        self._fwd = 0.0

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class _Threads:
    """torch's intra-op threads set for a block (a CPU worker runs with one by default), restored after."""

    def __init__(self, n: int):
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *_) -> None:
        torch.set_num_threads(self.before)


def step_times(
    trainer: Trainer, warmup: int, steps: int, min_s: float = MIN_PROFILE_S, max_steps: int = MAX_PROFILE_STEPS
) -> list[float]:
    """The wall time of each of the trainer's steps by its own loop's clock (what a run's seconds per step sums),
    after `warmup` steps: at least `steps`, then more in chunks of `steps` until `min_s` seconds of them have run
    or `max_steps` (a mean over a few ms-long steps is one preemption on a shared machine away from 2x)."""
    clock = trainer.body.readout.seconds
    trainer.fit(trainer.step + warmup)
    start = len(clock)
    t0 = time.perf_counter()
    while True:
        trainer.fit(trainer.step + steps)
        if len(clock) - start >= max_steps or time.perf_counter() - t0 >= min_s:
            return list(clock[start:])


def round_steps(outer: DiLoCo) -> int:
    """The shortest round a copy of `outer` can be timed with: every fragment's exchange starts once per round, each
    on a step of its own with a plain step between, and tau (the steps a fragment overlaps) fits inside it."""
    sched = outer.schedule
    return max(2, 2 * sched.fragments, overlap_steps(sched) + 1)


def round_probe(outer: DiLoCo, h: int) -> DiLoCo:
    """A fresh copy of the (unwrapped) `outer` with a round every `h` steps: each round does the same work as the
    original's (the same vector, exchange, compressor and outer step), in fewer steps."""
    probe = copy.deepcopy(outer)
    probe.inner_steps = int(h)
    return probe


def round_seconds(trainer: Trainer, plain: Trainer, h: int, cycles: int = ROUND_CYCLES) -> float:
    """Extra seconds one round of `trainer`'s outer strategy (a round every `h` steps, from step 0) costs a worker
    beyond `h` steps of `plain` (the same job without it): after one round of warm-up each, `cycles` times a round of
    one then h steps of the other, side by side so that both see the same load; the median of the paired
    differences, never below 0. On World.single the outer strategy's collectives are the identity (LoneComm): what
    is timed is its local work (outer step, compression of the real vector, copies, bookkeeping). Steps run one by
    one (Trainer.train_step, timed as its fit loop times them) rather than through fit, whose end would run the
    strategy's final synchronisation after every round."""
    diffs = []
    for i in range(cycles + 1):
        took = []
        for t in (trainer, plain):
            t0 = time.perf_counter()
            for _ in range(h):
                t.train_step()
            took.append(time.perf_counter() - t0)
        if i:  # the first is warm-up
            diffs.append(took[0] - took[1])
    return max(statistics.median(diffs), 0.0)


def _cache_path(key: str, cache: Path | None) -> Path:
    return (cache or cache_dir()) / f"{key}.json"


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def cached_seconds(
    prof: Profile,
    label: str,
    measure: Callable[[], float],
    threads: int = 1,
    refresh: bool = False,
    cache: Path | None = None,
) -> tuple[float, bool]:
    """(`measure()` on `threads` threads, whether it came from the cache): a timing of the profiled model's outer work
    cached beside its profile under `label` (the outer strategy's spec, and what else the timing depends on)."""
    path = _cache_path(f"{prof.fingerprint}-rounds", cache)
    known = json.loads(path.read_text()) if path.is_file() else {}
    if label in known and not refresh:
        return float(known[label]), True
    with _Threads(threads):
        value = measure()
    known = json.loads(path.read_text()) if path.is_file() else {}  # another planner may have added its own
    _write(path, {**known, label: value})
    return value, False


def cached_round_seconds(
    prof: Profile,
    label: str,
    make_trainer: Callable[[], Trainer],
    make_plain: Callable[[], Trainer],
    h: int,
    threads: int = 1,
    refresh: bool = False,
    cache: Path | None = None,
) -> tuple[float, bool]:
    """(round_seconds of the trainers `make_trainer()` (with the outer strategy) and `make_plain()` (without) build,
    whether it came from the cache); cached beside the profile by the outer strategy's `label` (its spec)."""
    return cached_seconds(prof, label, lambda: round_seconds(make_trainer(), make_plain(), h), threads, refresh, cache)


def profile_step(
    trainer: Trainer,
    batch,
    steps: int = 16,
    warmup: int = 3,
    threads: int = 1,
    settings: str = "",
    refresh: bool = False,
    cache: Path | None = None,
    min_s: float = MIN_PROFILE_S,
) -> Profile:
    """Profile the step of `trainer` (built on World.single, no outer strategy, never stepped) for at least `steps`
    steps after `warmup` (and more up to `min_s` seconds: step_times); `batch`: one of its batches (the
    fingerprint's shapes and the activation peak's step). Cached on disk by fingerprint; `settings` (the step's
    precision, micro-batch, clipping, optimizer) joins it."""
    device = trainer.world.device
    model, optimizer = trainer.model, trainer.optimizer
    key = fingerprint(model, batch, f"v4:{device.type}:{_device_name(device)}:{settings}:{steps}:{threads}")
    path = _cache_path(key, cache)
    if path.is_file() and not refresh:
        data = json.loads(path.read_text())
        data["cached"] = True
        return Profile(**data)
    modules = _ModuleClock(model, device)
    split = _SplitClock(model, optimizer, device)
    try:
        with _Threads(threads):
            whole = step_times(trainer, warmup, steps, min_s)
            # the activation peak on one more forward and backward: the meter's hooks cost time, so it is kept out
            # of the timed steps; it leaves gradients, which the state's bytes count
            with SavedTensorMeter(exclude=list(model.parameters())) as meter:
                trainer.step_fn(model, to_device(batch, device), trainer.body.loss_fn)
    finally:
        modules.close()
        split.close()
    fwd, opt = split.forward[-len(whole) :], split.optimizer[-len(whole) :]
    sb = state_bytes(model, optimizer)
    med = statistics.median(whole)
    ordered = sorted(whole)
    prof = Profile(
        fingerprint=key,
        device=_device_name(device),
        batch_size=int(batch_size(batch)),
        forward_s=statistics.median(fwd),
        backward_s=statistics.median(max(w - f - o, 0.0) for w, f, o in zip(whole, fwd, opt)),
        optimizer_s=statistics.median(opt),
        step_s=med,
        spread=(ordered[-2] - ordered[1]) / med if med > 0 and len(whole) > 3 else 0.0,
        activation_peak_bytes=int(meter.peak),
        param_bytes=sb.params,
        grad_bytes=sb.grads,
        optimizer_bytes=sb.optimizer,
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers() if b.is_floating_point()),
        param_numels=[p.numel() for p in model.parameters()],
        step_samples=whole,
        modules_s=modules.per_step(len(split.forward)),
        steps=len(whole),
    )
    _write(path, asdict(prof))
    return prof
