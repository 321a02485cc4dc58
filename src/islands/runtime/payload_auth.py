"""Authenticated tensor payloads between islands (issue #20, SOTA-930): every byte an outer strategy sends
carries an HMAC-SHA256 under a key only the job's members hold, so a tensor altered, injected or replayed on
the network path is refused instead of averaged into the model.

gloo and NCCL move tensors over their own connections with no integrity check; the control plane
(islands.runtime.auth) authenticates the store, not these bytes. `AuthenticatedComm` wraps the Comm an outer
strategy exchanges over ("cross") and changes how each collective runs:

    every contribution is packed as  bytes of the tensor + 32-byte tag,
    tag = HMAC(key, domain | kind | call number | sender | receiver | dtype | shape | bytes)

and all-gathered (or sent point to point); each receiver checks every tag before it uses any byte, then
combines the contributions itself, in rank order, so every rank computes the same sum. What the tag binds:
  * the key: derived from the job's token and a nonce every rank draws at the start, so a payload recorded
    in an earlier job (same token) does not verify in this one (a rank's own fresh nonce is in its key);
  * the call number: ranks make the same collectives in the same order, so call n's payload replayed into
    call n+1 does not verify; a payload moved to another kind of exchange does not either;
  * sender and receiver: a contribution relabelled as another rank's does not verify.

Costs: an all-reduce becomes an all-gather (each rank receives n-1 contributions instead of a ring's
2(n-1)/n; the same bytes at 2 islands) plus one HMAC per contribution sent and received (islands bench
control-plane measures both). The sum differs from the unauthenticated ring's in rounding (a fixed order
here). Static groups only: an elastic job re-forms its groups mid-exchange, which this call numbering does
not follow (validate refuses the combination).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading

import torch
import torch.distributed as dist

from islands.runtime.auth import derive_key

TAG = 32  # bytes of an HMAC-SHA256
_DOMAIN = b"islands-payload-v1|"
_NONCE = 16


class PayloadAuthError(RuntimeError):
    """A contribution whose tag did not verify: altered, injected or replayed on the way."""


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's bytes (a copy for a non-contiguous one), on the CPU for hashing."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


class AuthenticatedComm:
    """A Comm whose every exchange is authenticated (module docstring). `inner`: the Comm to wrap (its ledger
    counts the packed bytes, tags included). `token`: the job's secret (ISLANDS_TOKEN). Collective: every
    rank of `inner`'s group constructs it at the same point (the ranks trade their nonces)."""

    authenticated = True

    def __init__(self, inner, token: str):
        self.inner = inner
        self._calls = 0
        self._lock = threading.Lock()
        nonce = torch.frombuffer(bytearray(os.urandom(_NONCE)), dtype=torch.uint8)
        nonces = inner.all_gather(nonce, kind="payload_auth_nonce") if inner.size > 1 else [nonce]
        scope = b"".join(bytes(n.tolist()) for n in nonces)
        self._key = derive_key(token, "payload|" + scope.hex())

    # ---- what the wrapped Comm already says -----------------------------------------------------------
    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def ledger(self):
        return self.inner.ledger

    @property
    def group(self):
        return self.inner.group

    # ---- tags -----------------------------------------------------------------------------------------
    def _call(self) -> int:
        with self._lock:
            self._calls += 1
            return self._calls

    def _tag(self, kind: str, call: int, sender: int, receiver: int, like: torch.Tensor, data: torch.Tensor) -> bytes:
        head = f"{kind}|{call}|{sender}|{receiver}|{like.dtype}|{tuple(like.shape)}|".encode()
        return hmac.new(self._key, _DOMAIN + head + memoryview(data.cpu().numpy()), hashlib.sha256).digest()

    def _pack(self, t: torch.Tensor, kind: str, call: int, receiver: int) -> torch.Tensor:
        data = _as_bytes(t)
        tag = self._tag(kind, call, self.rank, receiver, t, data)
        return torch.cat([data, torch.frombuffer(bytearray(tag), dtype=torch.uint8).to(data.device)])

    def _open(self, packed: torch.Tensor, like: torch.Tensor, kind: str, call: int, sender: int,
              receiver: int) -> torch.Tensor:
        data, tag = packed[:-TAG], packed[-TAG:]
        if not hmac.compare_digest(bytes(tag.cpu().tolist()), self._tag(kind, call, sender, receiver, like, data)):
            raise PayloadAuthError(
                f"the {kind} payload from rank {sender} (exchange {call}) failed its MAC: it was altered, injected "
                "or replayed on the way, or the sender holds another token; it was not used")
        return data.clone().view(like.dtype).reshape(like.shape)

    def _gathered(self, t: torch.Tensor, kind: str, call: int, packed_parts: list[torch.Tensor]) -> list[torch.Tensor]:
        me = self.rank
        return [t if r == me else self._open(p, t, kind, call, r, -1) for r, p in enumerate(packed_parts)]

    # ---- collectives ------------------------------------------------------------------------------------
    def all_gather(self, tensor: torch.Tensor, kind: str = "all_gather") -> list[torch.Tensor]:
        if self.size == 1:
            return [tensor]
        call = self._call()
        parts = self.inner.all_gather(self._pack(tensor, kind, call, -1), kind=kind)
        return self._gathered(tensor, kind, call, parts)

    def all_gather_cat(self, tensor: torch.Tensor, kind: str = "all_gather") -> torch.Tensor:
        return torch.cat(self.all_gather(tensor, kind=kind)) if self.size > 1 else tensor

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "all_reduce") -> torch.Tensor:
        if self.size == 1:
            return tensor
        combined = _combine(self.all_gather(tensor.clone(), kind=kind), op)
        tensor.copy_(combined)
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "all_reduce"):
        """The gather is issued now, in the caller's order on the group (as the plain Comm issues its
        all-reduce); the checks and the sum run when it lands. A Future of the tensor."""
        if self.size == 1:
            fut = torch.futures.Future()
            fut.set_result(tensor)
            return fut
        call = self._call()
        mine = tensor.clone()
        packed = self._pack(mine, kind, call, -1)
        parts = [torch.empty_like(packed) for _ in range(self.size)]
        nbytes = packed.numel()
        ledger = self.ledger
        ledger.record(kind, nbytes, (self.size - 1) * nbytes)
        ledger.begin()
        work = dist.all_gather(parts, packed, group=self.group, async_op=True)

        def landed(f):
            ledger.end()
            f.wait()  # raises the collective's own error, if any
            tensor.copy_(_combine(self._gathered(mine, kind, call, parts), op))
            return tensor

        return work.get_future().then(landed)

    def broadcast(self, tensor: torch.Tensor, src: int, kind: str = "broadcast") -> torch.Tensor:
        """`src` is a global rank, as in torch.distributed; every receiver checks the source's tag."""
        if self.size == 1:
            return tensor
        call = self._call()
        me = dist.get_rank()
        packed = self._pack(tensor, kind, call, -1) if me == src else \
            torch.empty(_as_bytes(tensor).numel() + TAG, dtype=torch.uint8, device=tensor.device)
        self.inner.broadcast(packed, src=src, kind=kind)
        if me != src:
            group_src = dist.get_group_rank(self.group, src) if self.group is not None else src
            tensor.copy_(self._open(packed, tensor, kind, call, group_src, -1))
        return tensor

    def exchange(self, sends: dict[int, torch.Tensor], recv_from: list[int], like: torch.Tensor | None = None,
                 kind: str = "p2p") -> dict[int, torch.Tensor]:
        got, wait = self.exchange_async(sends, recv_from, like, kind)
        wait()
        return got

    def exchange_async(self, sends: dict[int, torch.Tensor], recv_from: list[int], like: torch.Tensor | None = None,
                       kind: str = "p2p"):
        """Point to point, each message tagged for its receiver; checked in wait()."""
        call = self._call()
        me = self.rank
        if like is None and recv_from:
            if not sends:
                raise ValueError("exchange: pass like= (shape and dtype of what arrives) when sending nothing")
            like = next(iter(sends.values()))
        packed = {p: self._pack(t, kind, call, p) for p, t in sends.items()}
        shell = torch.empty(_as_bytes(like).numel() + TAG, dtype=torch.uint8, device=like.device) if recv_from else None
        raw, wait_inner = self.inner.exchange_async(packed, recv_from, like=shell, kind=kind)
        got: dict[int, torch.Tensor] = {p: torch.empty_like(like) for p in recv_from}

        def wait() -> None:
            wait_inner()
            for p in recv_from:
                got[p].copy_(self._open(raw[p], like, kind, call, p, me))

        return got, wait

    def send(self, tensor: torch.Tensor, dst: int, kind: str = "p2p") -> None:
        raise NotImplementedError("authenticated payloads run point to point through exchange() only")

    recv = send

    def reduce_scatter(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "reduce_scatter"):
        raise NotImplementedError("authenticated payloads do not run reduce-scatter (no outer strategy uses it)")


def _combine(parts: list[torch.Tensor], op) -> torch.Tensor:
    """The contributions combined in rank order (the same on every rank)."""
    out = parts[0].clone()
    if op == dist.ReduceOp.SUM:
        for p in parts[1:]:
            out += p
    elif op == dist.ReduceOp.MAX:
        for p in parts[1:]:
            out = torch.maximum(out, p)
    elif op == dist.ReduceOp.MIN:
        for p in parts[1:]:
            out = torch.minimum(out, p)
    elif op == dist.ReduceOp.AVG:
        for p in parts[1:]:
            out += p
        out /= len(parts)
    else:
        raise NotImplementedError(f"authenticated all_reduce supports SUM, AVG, MAX and MIN; got {op}")
    return out


def authenticate_payloads(world, token: str | None = None) -> AuthenticatedComm:
    """Make every outer strategy built on `world` from now on exchange authenticated payloads (collective over
    the islands: call it on every rank, before building the strategy). `token`: the job's secret (default
    ISLANDS_TOKEN, which `islands train` sets for its workers)."""
    token = token if token is not None else os.environ.get("ISLANDS_TOKEN", "")
    if not token:
        raise ValueError("authenticated payloads need the job's token: pass token=... or set ISLANDS_TOKEN on "
                         "every worker (the same secret)")
    comm = AuthenticatedComm(world.comm("cross"), token)
    world.comms = {**(world.comms or {}), "cross": comm}
    return comm
