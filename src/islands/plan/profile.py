"""One worker's step, profiled once on the device and cached: forward, backward and optimizer time, per top-level
module forward time, the activation peak (bytes autograd holds for backward) and the training state's bytes.

The cache key is the model's fingerprint (class, parameter names, shapes and dtypes, the batch's shapes), the device
and the torch version: the same model on the same machine is profiled once; `refresh=True` measures again.
Times are medians over `steps` steps after `warmup` (with the spread of those steps kept, as the profile's own
error); the batch comes from the task's own data, as the first batch of a training run would.
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
from islands.memory.accounting import SavedTensorMeter, state_bytes
from islands.memory.step import ForwardBackward

CACHE_ENV = "ISLANDS_PLAN_CACHE"
MIN_PROFILE_S = 2.0  # a fast model's profile runs this long (or MAX_PROFILE_STEPS), beyond its minimum of steps
MAX_PROFILE_STEPS = 400


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "islands" / "plan"))


@dataclass(frozen=True)
class Profile:
    """One worker's measured step at `batch_size` samples on `device`."""

    fingerprint: str
    device: str
    batch_size: int
    data_s: float  # next() of the task's loader
    forward_s: float
    backward_s: float
    optimizer_s: float
    step_s: float  # the whole step, measured as one (data + forward + backward + optimizer)
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

    def medians(self, steps: int) -> dict[str, float]:
        return {n: sum(v) / steps for n, v in self.times.items()}

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def profile_step(
    model: torch.nn.Module,
    loss_fn: Callable | None,
    next_batch: Callable[[], object],
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    device: torch.device | str = "cpu",
    steps: int = 16,
    warmup: int = 3,
    precision: str = "fp32",
    threads: int = 1,
    refresh: bool = False,
    cache: Path | None = None,
) -> Profile:
    """Profile a copy of `model` (the caller's stays untouched) for `steps` steps; cached on disk by fingerprint."""
    device = torch.device(device)
    batch = next_batch()
    size = batch_size(batch)
    key = fingerprint(model, batch, f"v3:{device.type}:{_device_name(device)}:{precision}:{steps}:{threads}")
    path = (cache or cache_dir()) / f"{key}.json"
    if path.is_file() and not refresh:
        data = json.loads(path.read_text())
        data["cached"] = True
        return Profile(**data)
    model = copy.deepcopy(model).to(device)
    optimizer = make_optimizer(model)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # as a training worker runs (one torch thread per CPU worker by default)
    step = ForwardBackward(precision=precision)
    clock = _ModuleClock(model, device)
    data_t, fwd, bwd, opt, whole = [], [], [], [], []
    fwd_box: list[float] = []
    pre = model.register_forward_pre_hook(lambda *_: fwd_box.append(time.perf_counter()))
    post = model.register_forward_hook(lambda *_: fwd_box.append(time.perf_counter()))
    try:
        i = 0
        # at least `steps` steps; a fast model keeps going for up to MIN_PROFILE_S (a mean over a few ms-long steps
        # is at the mercy of one preemption on a shared machine)
        t_start = time.perf_counter()
        while i < warmup + steps or (i < warmup + MAX_PROFILE_STEPS and time.perf_counter() - t_start < MIN_PROFILE_S):
            if i == warmup:
                clock.times.clear()
                t_start = time.perf_counter()
            _sync(device)
            t0 = time.perf_counter()
            b = to_device(next_batch(), device)
            t1 = time.perf_counter()
            fwd_box.clear()
            optimizer.zero_grad(set_to_none=True)
            step(model, b, loss_fn)
            _sync(device)
            t2 = time.perf_counter()
            optimizer.step()
            _sync(device)
            t3 = time.perf_counter()
            if i >= warmup:
                f = fwd_box[-1] - fwd_box[0] if len(fwd_box) >= 2 else 0.0
                data_t.append(t1 - t0)
                fwd.append(f)
                bwd.append(max(t2 - t1 - f, 0.0))
                opt.append(t3 - t2)
                whole.append(t3 - t0)
            i += 1
        # the activation peak on one more step: the meter's hooks cost time, so it is kept out of the timed steps
        optimizer.zero_grad(set_to_none=True)
        with SavedTensorMeter(exclude=list(model.parameters())) as meter:
            step(model, to_device(next_batch(), device), loss_fn)
        peak = meter.peak
    finally:
        torch.set_num_threads(before)
        pre.remove()
        post.remove()
        clock.close()
    sb = state_bytes(model, optimizer)
    med = statistics.median(whole)
    prof = Profile(
        fingerprint=key,
        device=_device_name(device),
        batch_size=int(size),
        data_s=statistics.median(data_t),
        forward_s=statistics.median(fwd),
        backward_s=statistics.median(bwd),
        optimizer_s=statistics.median(opt),
        step_s=med,
        spread=(sorted(whole)[-2] - sorted(whole)[1]) / med if med > 0 and len(whole) > 3 else 0.0,
        activation_peak_bytes=int(peak),
        param_bytes=sb.params,
        grad_bytes=sb.grads,
        optimizer_bytes=sb.optimizer,
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers() if b.is_floating_point()),
        param_numels=[p.numel() for p in model.parameters()],
        step_samples=whole,
        modules_s=clock.medians(len(whole)),
        steps=len(whole),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(prof)))
    os.replace(tmp, path)
    return prof
