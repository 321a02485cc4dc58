"""Authenticated tensor payloads between islands (issue #20, SOTA-930): every byte an outer strategy sends
carries an HMAC-SHA256 under a key only the job's members hold, so a tensor altered, injected or replayed on
the network path is refused instead of averaged into the model.

gloo and NCCL move tensors over their own connections with no integrity check; the control plane
(islands.runtime.elastic.auth) authenticates the store, not these bytes. `AuthenticatedComm` wraps the Comm an outer
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
A lone send or receive, which only two ranks make, is numbered per (sender, receiver) pair instead of by the
group's call count; a reduce-scatter runs as the checked all-gather, each rank keeping its slice.

Costs: an all-reduce becomes an all-gather (each rank receives n-1 contributions instead of a ring's
2(n-1)/n; the same bytes at 2 islands) plus one HMAC per contribution sent and received (islands bench
control-plane measures both). The sum differs from the unauthenticated ring's in rounding (a fixed order
here).

Elastic jobs re-form their groups mid-exchange, which this call numbering does not follow; there the
ElasticComm tags its own operations (`ElasticComm.authenticate`, `elastic_tags`): the key comes from the token
and the job's random id, and each tag binds the operation's agreed key e/<epoch>/s/<seq> and the members'
names instead of a call number and ranks (docs/membership.md, "Security").
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from islands.runtime.comm import Comm, CommWrapper
from islands.runtime.elastic.auth import derive_key

TAG = 32  # bytes of an HMAC-SHA256
_DOMAIN = b"islands-payload-v1|"
_ELASTIC_DOMAIN = b"islands-elastic-payload-v1|"
_NONCE = 16


class PayloadAuthError(RuntimeError):
    """A contribution whose tag did not verify: altered, injected or replayed on the way."""

    exit_code = 1  # an elastic worker that refused a payload leaves the job (islands.runtime.world's excepthook)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's bytes (a copy for a non-contiguous one), on the CPU for hashing."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


class PayloadTags:
    """Packs tensors with a tag under one key and opens them again. `fields`: what a tag binds besides the dtype,
    shape and bytes (here: kind, call number, sender and receiver ranks; an elastic job's: kind, operation key,
    sender and receiver names), JSON-encoded so that no two field lists hash alike."""

    def __init__(self, key: bytes, domain: bytes):
        self.key, self.domain = key, domain

    def tag(self, fields: tuple, like: torch.Tensor, data: torch.Tensor) -> bytes:
        head = json.dumps([*map(str, fields), str(like.dtype), list(like.shape)]).encode() + b"\0"
        # the ignore: numpy's stubs give ndarray __buffer__ only for Python >= 3.12 (mypy checks as 3.10)
        body = memoryview(data.cpu().numpy())  # type: ignore[arg-type]
        return hmac.new(self.key, self.domain + head + body, hashlib.sha256).digest()

    def pack(self, t: torch.Tensor, fields: tuple) -> torch.Tensor:
        """t's bytes followed by their 32-byte tag, one flat uint8 tensor."""
        data = _as_bytes(t)
        tag = self.tag(fields, t, data)
        return torch.cat([data, torch.frombuffer(bytearray(tag), dtype=torch.uint8).to(data.device)])

    def open(self, packed: torch.Tensor, like: torch.Tensor, fields: tuple) -> torch.Tensor | None:
        """What `packed` carries, shaped like `like`, or None when its tag does not verify (nothing is used)."""
        data, tag = packed[:-TAG], packed[-TAG:]
        if data.numel() != _as_bytes(like).numel():
            return None
        if not hmac.compare_digest(bytes(tag.cpu().tolist()), self.tag(fields, like, data)):
            return None
        return data.clone().view(like.dtype).reshape(like.shape)

    @staticmethod
    def shell(like: torch.Tensor) -> torch.Tensor:
        """A receive buffer for a packed `like`."""
        return torch.empty(_as_bytes(like).numel() + TAG, dtype=torch.uint8, device=like.device)


def elastic_tags(token: str, job_id: str) -> PayloadTags:
    """An elastic job's payload tags: a key from the token and the job's random id, so a payload recorded in
    another job (the same token) does not verify in this one; no nonces to trade, so joiners need none."""
    if not job_id:
        raise ValueError("authenticated elastic payloads need the job's id (JobSpec.job_id)")
    return PayloadTags(derive_key(token, "elastic-payload|" + job_id), _ELASTIC_DOMAIN)


class AuthenticatedComm(CommWrapper):
    """A Comm whose every exchange is authenticated (module docstring). `inner`: the Comm to wrap (its ledger
    counts the packed bytes, tags included). `token`: the job's secret (ISLANDS_TOKEN). Collective: every
    rank of `inner`'s group constructs it at the same point (the ranks trade their nonces)."""

    authenticated = True
    elastic = False  # fixed worlds only: an elastic job's ElasticComm tags its own operations (authenticate)
    epoch: int | None = None

    def __init__(self, inner, token: str):
        super().__init__(inner)
        self._calls = 0
        self._pairs: dict[tuple[int, int], int] = {}  # messages per (sender, receiver), for send and recv
        self._lock = threading.Lock()
        nonce = torch.frombuffer(bytearray(os.urandom(_NONCE)), dtype=torch.uint8)
        nonces = inner.all_gather(nonce, kind="payload_auth_nonce") if inner.size > 1 else [nonce]
        scope = b"".join(bytes(n.tolist()) for n in nonces)
        self._tags = PayloadTags(derive_key(token, "payload|" + scope.hex()), _DOMAIN)

    # ---- what the wrapped Comm already says: size, rank, ledger, group, all_gather_object (CommWrapper) ----------
    @property
    def tags(self) -> PayloadTags:
        """This job's payload tags, for exchanges that are not this Comm's collectives (the parameter server's
        point-to-point messages, islands.sync.outer.ps_link.Sealer)."""
        return self._tags

    # ---- tags -----------------------------------------------------------------------------------------
    def _call(self) -> int:
        with self._lock:
            self._calls += 1
            return self._calls

    def _pack(self, t: torch.Tensor, kind: str, call: int, receiver: int) -> torch.Tensor:
        return self._tags.pack(t, (kind, call, self.rank, receiver))

    def _open(
        self, packed: torch.Tensor, like: torch.Tensor, kind: str, call: int, sender: int, receiver: int
    ) -> torch.Tensor:
        got = self._tags.open(packed, like, (kind, call, sender, receiver))
        if got is None:
            raise PayloadAuthError(
                f"the {kind} payload from rank {sender} (exchange {call}) failed its MAC: it was altered, injected "
                "or replayed on the way, or the sender holds another token; it was not used"
            )
        return got

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
        combined = combine_in_order(self.all_gather(tensor.clone(), kind=kind), op)
        tensor.copy_(combined)
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "all_reduce"):
        """The gather is issued now, in the caller's order on the group (as the plain Comm issues its
        all-reduce); the checks and the sum run when it lands. A Future of the tensor."""
        if self.size == 1:
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
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
            tensor.copy_(combine_in_order(self._gathered(mine, kind, call, parts), op))
            return tensor

        return work.get_future().then(landed)

    def broadcast(self, tensor: torch.Tensor, src: int, kind: str = "broadcast") -> torch.Tensor:
        """`src` is a global rank, as in torch.distributed; every receiver checks the source's tag."""
        if self.size == 1:
            return tensor
        call = self._call()
        me = dist.get_rank()
        packed = self._pack(tensor, kind, call, -1) if me == src else PayloadTags.shell(tensor)
        self.inner.broadcast(packed, src=src, kind=kind)
        if me != src:
            group_src = dist.get_group_rank(self.group, src) if self.group is not None else src
            tensor.copy_(self._open(packed, tensor, kind, call, group_src, -1))
        return tensor

    exchange = Comm.exchange  # exchange_async, then wait: the same for any Comm

    def exchange_async(
        self, sends: dict[int, torch.Tensor], recv_from: list[int], like: torch.Tensor | None = None, kind: str = "p2p"
    ):
        """Point to point, each message tagged for its receiver; checked in wait()."""
        call = self._call()
        me = self.rank
        if like is None and recv_from:
            if not sends:
                raise ValueError("exchange: pass like= (shape and dtype of what arrives) when sending nothing")
            like = next(iter(sends.values()))
        packed = {p: self._pack(t, kind, call, p) for p, t in sends.items()}
        shell = PayloadTags.shell(like) if recv_from and like is not None else None  # like is set when any arrive
        raw, wait_inner = self.inner.exchange_async(packed, recv_from, like=shell, kind=kind)
        got: dict[int, torch.Tensor] = {p: torch.empty_like(like) for p in recv_from} if like is not None else {}

        def wait() -> None:
            wait_inner()
            for p in recv_from:
                assert like is not None  # set above when anything arrives
                got[p].copy_(self._open(raw[p], like, kind, call, p, me))

        return got, wait

    # A lone send or receive involves two ranks only, so it cannot take a number from the group's call count;
    # each ordered pair (sender, receiver) counts its own messages instead: the n-th send from a to b is the
    # n-th receive by b from a. Ranks here are global, as in torch.distributed's send and recv.
    def _pair(self, sender: int, receiver: int) -> int:
        with self._lock:
            n = self._pairs.get((sender, receiver), 0) + 1
            self._pairs[(sender, receiver)] = n
            return n

    def send(self, tensor: torch.Tensor, dst: int, kind: str = "p2p") -> None:
        me = dist.get_rank()
        self.inner.send(self._tags.pack(tensor, (kind, f"pair{self._pair(me, dst)}", me, dst)), dst, kind=kind)

    def recv(self, tensor: torch.Tensor, src: int, kind: str = "p2p") -> torch.Tensor:
        me = dist.get_rank()
        n = self._pair(src, me)
        packed = self.inner.recv(PayloadTags.shell(tensor), src, kind=kind)
        got = self._tags.open(packed, tensor, (kind, f"pair{n}", src, me))
        if got is None:
            raise PayloadAuthError(
                f"the {kind} message {n} from rank {src} failed its MAC: it was altered, injected or "
                "replayed on the way, or the sender holds another token; it was not used"
            )
        return tensor.copy_(got)

    def reduce_scatter(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "reduce_scatter") -> torch.Tensor:
        """Every rank's tagged tensor gathered and checked, combined in rank order; rank r keeps the r-th of n
        equal slices along dim 0 (an all-gather's bytes instead of a reduce-scatter's)."""
        n = self.size
        if n == 1:
            return tensor
        if tensor.shape[0] % n:
            raise ValueError(f"reduce_scatter: dim 0 of {tuple(tensor.shape)} must divide evenly over {n} ranks")
        whole = combine_in_order(self.all_gather(tensor.contiguous(), kind=kind), op)
        return whole.chunk(n)[self.rank].clone()


# How two contributions combine, per reduce op (AVG: a sum, divided once at the end). PREMUL_SUM is absent: its
# factor lives inside the op object, which a plain comparison cannot read.
_COMBINE: dict[object, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    dist.ReduceOp.SUM: torch.add,
    dist.ReduceOp.AVG: torch.add,
    dist.ReduceOp.PRODUCT: torch.mul,
    dist.ReduceOp.MAX: torch.maximum,
    dist.ReduceOp.MIN: torch.minimum,
    dist.ReduceOp.BAND: torch.bitwise_and,
    dist.ReduceOp.BOR: torch.bitwise_or,
    dist.ReduceOp.BXOR: torch.bitwise_xor,
}


def combine_in_order(parts: list[torch.Tensor], op) -> torch.Tensor:
    """The contributions combined in rank order (the same on every rank)."""
    fn = next((f for known, f in _COMBINE.items() if op == known), None)
    if fn is None:
        raise ValueError(
            f"authenticated payloads combine with SUM, AVG, PRODUCT, MAX, MIN, BAND, BOR or BXOR; got {op}"
        )
    out = parts[0].clone()
    for p in parts[1:]:
        out = fn(out, p)
    if op == dist.ReduceOp.AVG:
        out = out / len(parts) if out.is_floating_point() else out // len(parts)
    return out


def authenticate_payloads(world, token: str | None = None):
    """Make every outer strategy built on `world` from now on exchange authenticated payloads (call it on every
    rank, before building the strategy). `token`: the job's secret (default ISLANDS_TOKEN, which `islands train`
    sets for its workers). A static world: collective over the islands (the ranks trade nonces); returns the
    AuthenticatedComm. An elastic world: its ElasticComm tags its own operations from now on (nothing to
    trade; a joiner does the same before it enters); returns the membership. A follower of a k-worker island
    sends nothing across islands (its leader does): nothing to do there."""
    token = token if token is not None else os.environ.get("ISLANDS_TOKEN", "")
    if not token:
        raise ValueError(
            "authenticated payloads need the job's token: pass token=... or set ISLANDS_TOKEN on "
            "every worker (the same secret)"
        )
    membership = world.membership
    if membership is not None:
        membership.authenticate(token)  # a follower of a k-worker island has nothing to tag (its leader does)
        return membership
    # host tensors: a GPU job's gloo cross group stages around the authenticated Comm (World.comm), so the tags
    # hash host bytes
    comm = AuthenticatedComm(world.host_comm("cross"), token)
    world.comms = {**(world.comms or {}), "cross": comm}
    return comm
