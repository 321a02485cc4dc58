"""The Compressor contract: explicit per-tensor state, a payload, and how payloads combine.

A compressor turns one tensor into a `Payload` (the tensors that travel) and back. How payloads from
many ranks combine is declared, not discovered:

  SUMMABLE  payloads are all-reduced (summed) and the sum decodes to the sum of what each rank sent:
            casts, shared-scale quantisation, PowerSGD factors. Such a compressor may need one
            agreement round first (`agree`: PowerSGD's P, the shared quantisation scale).
  GATHERED  payloads are all-gathered and `combine_gathered` decodes them into one tensor (the mean,
            or a majority vote): top-k, random-k, sign, QSGD.

State is a plain dict per parameter NAME, created by `state(name, tensor)` and kept in `states`, so
it survives any regrouping of tensors into buckets and is checkpointed by `state_dict()`. Keys that
start with "_" are transient (never checkpointed).
"""

from __future__ import annotations

import enum
import importlib
import math
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


class Combine(enum.Enum):
    SUMMABLE = "summable"
    GATHERED = "gathered"


class NonFiniteGradientError(ValueError):
    """Raised instead of compressing a NaN/Inf: error feedback would carry it forever."""


@dataclass
class Agreed:
    """What the ranks agreed on before compressing: the reduced `agree` tensors and the rank count."""

    tensors: list[Tensor]
    parties: int = 1


@dataclass
class Payload:
    tensors: list[Tensor]  # what travels: summed (SUMMABLE) or gathered (GATHERED)
    shape: torch.Size
    dtype: torch.dtype
    shared: list[Tensor] = field(default_factory=list)  # identical on every rank already; not resent
    meta: dict[str, Any] = field(default_factory=dict)  # small facts every rank knows (levels, ...)
    agreed_nbytes: int = 0  # bytes this rank put into the agreement round for this tensor
    summands: int = 1  # how many ranks' payloads were summed into `tensors`

    @property
    def wire_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def nbytes(self) -> int:
        """Every byte this rank sends for the tensor: agreement round plus payload."""
        return self.wire_nbytes + self.agreed_nbytes


@runtime_checkable
class Compressor(Protocol):
    name: str
    combine: Combine
    agree_op: str  # "sum" or "max": how `agree` tensors are all-reduced

    def state(self, name: str, tensor: Tensor) -> dict: ...

    def agree(self, tensor: Tensor, state: dict) -> list[Tensor]: ...

    def compress(self, tensor: Tensor, state: dict, agreed: Agreed | None = None) -> Payload: ...

    def decompress(self, payload: Payload) -> Tensor: ...

    def decompress_mean(self, summed: Payload, out: Tensor | None = None) -> Tensor: ...

    def subtract_sent(self, x: Tensor, payload: Payload) -> Tensor: ...

    def absorb(self, state: dict, summed: Payload) -> None: ...

    def combine_gathered(self, payloads: list[Payload]) -> Tensor: ...

    def payload_nbytes(self, shape, dtype: torch.dtype) -> int: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


@runtime_checkable
class AddsResidual(Protocol):
    """A compressor that takes error feedback's add into its own pass over the vector: given the residual r and
    this round's delta g it compresses x = r + g, reading r and g once, and leaves x - decompress(payload) in a
    buffer, bit for bit what ErrorFeedback's add, compress and subtract_sent give. Such a compressor agrees on
    nothing before compressing (its `agree` is empty), so error feedback skips that step too."""

    def adds_residual(self, delta: Tensor, decay: float) -> bool:
        """Whether compress_residual takes this delta with the residual weighted by `decay`."""
        ...

    def compress_residual(
        self, residual: Tensor, delta: Tensor, out: Tensor, state: dict, decay: float = 1.0
    ) -> Payload:
        """The payload of compress(decay * residual + delta) (torch.add(delta, residual, alpha=decay)'s bits, or
        residual + delta at decay 1); `out` (residual's shape, fp32) becomes x - sent. NonFiniteGradientError,
        with `residual` untouched, when delta holds a NaN or Inf."""
        ...


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_float(name: str, tensor: Tensor) -> None:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: compressors take floating tensors {FLOAT_DTYPES}, got {tensor.dtype}")


def all_finite(tensor: Tensor) -> bool:
    """True when no entry is NaN/Inf. One min/max pass: NaN propagates through both and an Inf is
    an extreme, so this equals isfinite(t).all() at about 1/25 of its cost on CPU (no bool tensor)."""
    if not tensor.numel():
        return True
    lo, hi = torch.aminmax(tensor.detach())
    return math.isfinite(lo.item()) and math.isfinite(hi.item())


def check_finite(name: str, tensor: Tensor, where: str = "gradient") -> None:
    # Policy: raise, never skip. A NaN folded into an error-feedback residual poisons every later step.
    if not all_finite(tensor):
        raise non_finite_error(name, tensor, where)


def non_finite_error(name: str, tensor: Tensor, where: str = "gradient") -> NonFiniteGradientError:
    """The error for a tensor known to hold a NaN or Inf, counting them."""
    bad = int((~torch.isfinite(tensor)).sum())
    return NonFiniteGradientError(
        f"{where} of {name!r} has {bad} NaN/Inf value(s) of {tensor.numel()}; refusing to compress "
        "(fix the loss scale or skip the step before communication)"
    )


def cast(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """tensor.to(dtype), skipping the call when it would return the tensor itself (a dispatch each,
    and a compressor makes several per tensor and bucket)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def as_fp32(tensor: Tensor) -> Tensor:
    """A contiguous fp32 copy-or-view of any float tensor (compute in fp32, return in input dtype)."""
    t = cast(tensor.detach(), torch.float32)
    return t if t.is_contiguous() else t.contiguous()


def nbytes_of(numel: int, dtype: torch.dtype) -> int:
    return int(numel) * torch.empty((), dtype=dtype).element_size()


def numel_of(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def name_seed(seed: int, name: str) -> int:
    """A seed identical on every rank for the same name (crc32 is stable; hash() is salted)."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


# The compiled CPU loops (kernels.py, kernels_quant.py, kernels_dct.py), where numba is installed; False turns them
# off (the tests compare both paths).
USE_KERNELS = True
_KERNELS: dict[str, Any] = {}  # module name -> the module, or False where it cannot be imported


def cpu_kernels(tensor: Tensor, module: str = "kernels") -> Any:
    """islands.compress.<module> (kernels, kernels_quant, kernels_dct) for a CPU tensor when numba is there and
    USE_KERNELS is on, else None (the torch ops, which run on any device and give the same bits). Imported on
    first use: numba takes ~0.5 s."""
    if not USE_KERNELS or tensor.device.type != "cpu":
        return None
    if module not in _KERNELS:
        try:
            _KERNELS[module] = importlib.import_module(f"islands.compress.{module}")
        except ImportError:  # numba missing: the torch path
            _KERNELS[module] = False
    return _KERNELS[module] or None


def _clone_state(st: dict) -> dict:
    return {k: (v.detach().clone() if isinstance(v, Tensor) else v) for k, v in st.items() if not k.startswith("_")}


class CompressorBase(ABC):
    """Per-name state bookkeeping and the defaults of the contract; subclasses add the maths."""

    name = "base"
    combine = Combine.SUMMABLE
    agree_op = "sum"
    # SUMMABLE payloads normally add on the wire (all-reduce); "gather": all-gathered, then `merge` adds them
    sum_transport = "all_reduce"
    # ||x - decode(compress(x))|| < ||x||: what error feedback needs for its residual to stay bounded.
    # Compressors rescaled to be unbiased (random-k's n/k, QSGD's levels) can send more than they got.
    contractive = True
    # Whether the consumers of this compressor (the DDP hook, outer exchanges) wrap it in ErrorFeedback
    # (SOTA-214): on by default for the biased compressors, set per instance by their `ef` argument.
    ef = False

    def __init__(self) -> None:
        self.states: dict[str, dict] = {}

    # -- state -------------------------------------------------------------------------------------
    def init_state(self, name: str, tensor: Tensor) -> dict:
        return {}

    def state(self, name: str, tensor: Tensor) -> dict:
        check_float(name, tensor)
        st = self.states.get(name)
        if st is None:
            st = self.init_state(name, tensor)
            st["shape"] = list(tensor.shape)
            self.states[name] = st
        elif list(tensor.shape) != st["shape"]:
            raise ValueError(f"{name!r}: shape {list(tensor.shape)} differs from its state's {st['shape']}")
        st["_name"] = name
        return st

    def state_dict(self) -> dict:
        return {"states": {n: _clone_state(s) for n, s in self.states.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        if "states" not in state_dict:
            raise ValueError(f"{self.name}: state_dict lacks 'states' (keys: {sorted(state_dict)})")
        self.states = {n: _clone_state(s) for n, s in state_dict["states"].items()}

    # -- the maths: every compressor implements these (abstract: a subclass missing one fails at construction) --
    @abstractmethod
    def compress(self, tensor: Tensor, state: dict, agreed: Agreed | None = None) -> Payload:
        """`tensor` (with its per-name `state`, and what the ranks agreed this round) -> the payload to send."""

    @abstractmethod
    def decompress(self, payload: Payload) -> Tensor:
        """A payload (one rank's, or the sum of SUMMABLE ones) -> the dense tensor it stands for."""

    @abstractmethod
    def payload_nbytes(self, shape, dtype: torch.dtype) -> int:
        """Bytes one payload of a tensor of `shape` and `dtype` puts on the wire (what the ledger counts)."""

    # -- defaults ----------------------------------------------------------------------------------
    def agree(self, tensor: Tensor, state: dict) -> list[Tensor]:
        return []

    def absorb(self, state: dict, summed: Payload) -> None:
        """Take what a compressor keeps from the summed payload into its state (PowerSGD's factors); by default
        a compressor keeps nothing."""
        return None

    def decompress_mean(self, summed: Payload, out: Tensor | None = None) -> Tensor:
        """The mean, in fp32, of the `summed.summands` contributions summed into `summed`; written
        into `out` (contiguous fp32, the payload's shape) when given, which is then returned."""
        mean = cast(self.decompress(summed), torch.float32).reshape(summed.shape)
        return torch.div(mean, summed.summands, out=out) if out is not None else mean / summed.summands

    def subtract_sent(self, x: Tensor, payload: Payload) -> Tensor:
        """x - decompress(payload) in fp32: what error feedback keeps. x is the fp32 tensor compress()
        was given (cast); a compressor whose payload never shares x's memory may overwrite x."""
        return x - cast(self.decompress(payload), torch.float32)

    def exact(self, payload: Payload) -> bool:
        """True when decompress(payload) is bit for bit the tensor compress() was given (error feedback
        then has no residual to compute). False unless a compressor knows better."""
        return False

    def merge(self, parts: list[list[Tensor]]) -> list[Tensor]:
        """With sum_transport="gather": the sum of every rank's tensors (parts[rank]), in rank order."""
        return [
            torch.stack([p[i].to(torch.float32) for p in parts]).sum(0).to(parts[0][i].dtype)
            for i in range(len(parts[0]))
        ]

    def combine_gathered(self, payloads: list[Payload]) -> Tensor:
        """Mean of the decoded payloads, summed in rank order so every rank gets the same bits."""
        acc = torch.zeros(payloads[0].shape, dtype=torch.float32, device=_device_of(payloads[0]))
        for p in payloads:
            acc += self.decompress(p).to(torch.float32)
        return (acc / len(payloads)).to(payloads[0].dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _device_of(payload: Payload) -> torch.device:
    ts = payload.tensors or payload.shared
    return ts[0].device if ts else torch.device("cpu")


class SeededMixin:
    """One torch.Generator per device, never the global RNG; its state is part of the checkpoint."""

    def _init_rng(self, seed: int) -> None:
        self.seed = int(seed)
        self._generators: dict[str, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        g = self._generators.get(key)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._generators[key] = g
        return g

    def rng_state_dict(self) -> dict:
        return {"seed": self.seed, "generators": {k: g.get_state().clone() for k, g in self._generators.items()}}

    def load_rng_state_dict(self, sd: dict) -> None:
        self.seed = int(sd["seed"])
        self._generators = {}
        for key, st in sd["generators"].items():
            g = torch.Generator(device=torch.device(key))
            g.set_state(st.clone())
            self._generators[key] = g
