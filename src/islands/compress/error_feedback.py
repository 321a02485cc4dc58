"""Error feedback around any compressor (SOTA-214), with DGC's momentum corrections (LIT-056).

Per parameter NAME (never per bucket, never in p.grad, so zero_grad() and bucket rebuilds lose
nothing) it keeps a residual r in fp32:
    x = r + g                 the corrected input (g after optional local clipping / momentum);
                              with decay d < 1, x = d r + g (SparseLoCo's decayed accumulator)
    send compress(x)          in the input's dtype
    r = x - decompress(sent)  this rank's own contribution; exact for top-k, else within fp32
                              rounding: |sent + r - x| <= 2^-23 (|sent| + |x|) per entry
With momentum m > 0 (DGC momentum correction) g is replaced by u = m u + g, and u is zeroed where
the compressor sent something (momentum factor masking), so the optimizer must run without momentum.
A compressor that is an AddsResidual (topkq) forms x itself inside its own pass over the vector, where there is no
momentum or clipping (`fuse`, on by default; the same bits either way).
"""

from __future__ import annotations

import typing
from typing import TypeVar

import torch
from torch import Tensor

from islands.compress.base import (
    AddsResidual,
    Agreed,
    Compressor,
    CompressorBase,
    Payload,
    as_fp32,
    cast,
    check_finite,
)

_C = TypeVar("_C", bound=Compressor)


class ErrorFeedback(CompressorBase):
    def __init__(
        self,
        inner: CompressorBase,
        momentum: float = 0.0,
        clip_norm: float | None = None,
        decay: float = 1.0,
        fuse: bool = True,
    ):
        """`fuse`: where the compressor offers it (AddsResidual), let it do the add r + g inside its own pass over
        the vector (the same bits, one pass over memory instead of three); False keeps the separate passes."""
        super().__init__()
        if isinstance(inner, ErrorFeedback):
            raise TypeError("ErrorFeedback(ErrorFeedback(...)) would feed the error back twice")
        if not inner.contractive:
            raise ValueError(
                f"error feedback needs a contractive compressor (one whose error is smaller than its input); "
                f"{inner.name} rescales to stay unbiased, so the residual would grow without bound. "
                f"Use it without error feedback (ef=0, its default), or topk, int8/int4, sign or powersgd with ef=1"
            )
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"error-feedback momentum must be in [0, 1), got {momentum!r}")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"error-feedback clip_norm must be > 0 or None, got {clip_norm!r}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"error-feedback decay must be in (0, 1], got {decay!r}")
        self.inner = inner
        self.decay = float(decay)
        self.momentum = float(momentum)
        self.clip_norm = clip_norm
        self.fuse = bool(fuse)
        self.name = f"ef({inner.name})"
        self.combine = inner.combine
        self.agree_op = inner.agree_op
        self.sum_transport = getattr(inner, "sum_transport", "all_reduce")

    def init_state(self, name: str, tensor: Tensor) -> dict:
        st = {"residual": torch.zeros(tensor.shape, dtype=torch.float32, device=tensor.device)}
        if self.momentum:
            st["momentum"] = torch.zeros(tensor.shape, dtype=torch.float32, device=tensor.device)
        return st

    def _inner_state(self, state: dict, tensor: Tensor) -> dict:
        return self.inner.state(state["_name"], tensor)

    def _corrected(self, tensor: Tensor, state: dict) -> Tensor:
        """r + g (or r + u with momentum correction); cached so agree() and compress() see one value."""
        cached = state.pop("_corrected", None)
        if cached is not None:
            return cached
        name = state["_name"]
        g = as_fp32(tensor).reshape(tensor.shape)
        if not state.pop("_finite", False):  # compress_and_average checked every rank's inputs already
            check_finite(name, g)
        if self.clip_norm is not None:  # DGC local gradient clipping, per tensor
            norm = float(g.norm())
            if norm > self.clip_norm:
                g = g * (self.clip_norm / norm)
        if self.momentum:
            state["momentum"].mul_(self.momentum).add_(g)
            g = state["momentum"]
        residual = state["residual"]
        # into a buffer kept from the last step: a fresh tensor of this size per step costs more in page
        # faults than the addition itself (about 7x on the default LM's matrices)
        spare = state.get("_spare")
        if spare is None or spare.shape != residual.shape or spare.device != residual.device:
            spare = torch.empty_like(residual)
        if self.decay != 1.0:
            return torch.add(g, residual, alpha=self.decay, out=spare)
        return torch.add(residual, g, out=spare)

    def _adder(self, tensor: Tensor) -> AddsResidual | None:
        """The inner compressor where it takes this round's add itself: plain error feedback (no momentum, no
        clipping) on an fp32 tensor (others are cast to their dtype after the add)."""
        inner = self.inner
        if not (self.fuse and isinstance(inner, AddsResidual)) or self.momentum or self.clip_norm is not None:
            return None
        return inner if tensor.dtype == torch.float32 and inner.adds_residual(tensor, self.decay) else None

    def agree(self, tensor: Tensor, state: dict) -> list[Tensor]:
        if self._adder(tensor) is not None:
            return []  # AddsResidual: the compressor agrees on nothing, so x is not needed yet
        x = self._corrected(tensor, state)
        state["_corrected"] = x
        return self.inner.agree(cast(x, tensor.dtype), self._inner_state(state, tensor))

    def compress(self, tensor: Tensor, state: dict, agreed: Agreed | None = None) -> Payload:
        adder = self._adder(tensor)
        if adder is not None and "_corrected" not in state:
            return self._compress_adding(adder, tensor, state)
        x = self._corrected(tensor, state)
        payload = self.inner.compress(cast(x, tensor.dtype), self._inner_state(state, tensor), agreed)
        if not self.momentum and tensor.dtype == torch.float32 and self.inner.exact(payload):
            state["residual"].zero_()  # sent whole (PowerSGD's vectors): nothing left behind
            state["_spare"] = None if _viewed_by(x, payload) else x
            return payload
        if not self.momentum:
            old = state["residual"]
            state["residual"] = self.inner.subtract_sent(x, payload)
            state["_spare"] = old if state["residual"] is x else (None if _viewed_by(x, payload) else x)
            return payload
        own = cast(self.inner.decompress(payload), torch.float32)
        state["residual"] = x - own
        # DGC momentum factor masking: sent coordinates restart their momentum
        state["momentum"].masked_fill_(own != 0, 0.0)
        return payload

    def _compress_adding(self, adder: AddsResidual, tensor: Tensor, state: dict) -> Payload:
        """The round with the add in the compressor's pass: x - sent goes into last round's spare buffer, which
        then becomes the residual (the old residual the next spare), as the separate passes leave them."""
        state.pop("_finite", None)  # the compressor checks delta for NaN/Inf in its pass, for free
        residual = state["residual"]
        spare = state.get("_spare")
        if spare is None or spare.shape != residual.shape or spare.device != residual.device:
            spare = torch.empty_like(residual)
        payload = adder.compress_residual(
            residual, tensor.detach(), spare, self._inner_state(state, tensor), decay=self.decay
        )
        state["residual"], state["_spare"] = spare, residual
        return payload

    def decompress(self, payload: Payload) -> Tensor:
        return self.inner.decompress(payload)

    def decompress_mean(self, summed: Payload, out: Tensor | None = None) -> Tensor:
        return self.inner.decompress_mean(summed, out)

    def absorb(self, state: dict, summed: Payload) -> None:
        self.inner.absorb(self.inner.states[state["_name"]], summed)

    def combine_gathered(self, payloads: list[Payload]) -> Tensor:
        return self.inner.combine_gathered(payloads)

    def merge(self, parts: list[list[Tensor]]) -> list[Tensor]:
        return self.inner.merge(parts)

    def payload_nbytes(self, shape, dtype, **kw) -> int:
        return self.inner.payload_nbytes(shape, dtype, **kw)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.inner.load_state_dict(state_dict["inner"])


def _viewed_by(x: Tensor, payload: Payload) -> bool:
    """True when a payload tensor shares x's memory: x must then not be reused as next step's buffer,
    or a caller still holding this payload would see it change."""
    ptr = x.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == ptr for t in (*payload.tensors, *payload.shared))


def with_error_feedback(compressor: _C) -> _C | ErrorFeedback:
    """The compressor as its consumers run it: wrapped in ErrorFeedback when it asks for it (its `ef`), with
    TopK's DGC momentum and clipping and a compressor's residual decay (`ef_decay`, TopKQ's); an ErrorFeedback
    or a compressor built with ef=False as given."""
    if isinstance(compressor, ErrorFeedback) or not getattr(compressor, "ef", False):
        return compressor
    # `ef` is a CompressorBase attribute: a compressor asking for error feedback is one
    return ErrorFeedback(
        typing.cast(CompressorBase, compressor),
        momentum=getattr(compressor, "ef_momentum", 0.0),
        clip_norm=getattr(compressor, "ef_clip", None),
        decay=getattr(compressor, "ef_decay", 1.0),
    )
