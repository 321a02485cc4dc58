"""Compressed gossip: every directed edge keeps a public estimate of its sender (CHOCO-style, LIT-908).

Plain gossip sends whole parameter vectors. Compressing them directly would mix each island with a
top-k sketch of its peers, which is not their parameters. Instead, for every directed edge i -> p both
ends keep the same estimate h[i->p] of x_i, starting from the common starting point (one broadcast
at setup makes it common). In a round where the topology has i send to p:

    i:  c = Q(x_i - h[i->p]);  h[i->p] += decode(c);  send c            (Q: any compressor)
    p:  h[i->p] += decode(c)                                             (the same bits on both ends)

and then each node moves toward its in-peers' estimates, measured against its own out-edge estimates:

    x_p += gamma / (1 + d) * (sum_{j in in(p)} h[j->p] - sum_{q in out(p)} h[p->q])

Why the second sum is the node's own out-edge estimates and not x_p itself: both sums lag their true
vectors by the same kind of compression error, so their difference is an estimate of how far the peers
are, not of how far they are from the starting point; and over a regular graph (in-degree = out-degree
= d at every node) every edge appears once in some node's first sum and once in its sender's second,
so a round leaves the islands' average unchanged, as uncompressed gossip does. With a lossless Q and
gamma = 1 the update is exactly uncompressed gossip's (x_p + sum x_j) / (1 + d).

What an edge's estimate costs: one fp32 copy of the parameters per directed edge a node has used (ring:
2 out + 2 in; exp over n islands: log2 n out + log2 n in), checkpointed with the strategy. The payload
travels as one uint8 tensor whose layout (the compressor's payload tensors, their shapes and dtypes) is
fixed by the compressor and the parameter count, so a receiver knows it without a header. Compressors
whose payload leans on rank-shared tensors (shared-seed random-k, QSGD's agreed scale, PowerSGD's
factor) have no self-contained payload and are refused.
"""

from __future__ import annotations

import torch
from torch import Tensor

from islands.compress.base import Payload
from islands.compress.error_feedback import ErrorFeedback


def _bare(compressor):
    """The compressor itself: the edge estimates already carry what error feedback would (the unsent part)."""
    return compressor.inner if isinstance(compressor, ErrorFeedback) else compressor


def _fresh_state(compressor, x: Tensor) -> dict:
    return {**compressor.init_state("layout", x), "shape": list(x.shape)}


def check_compressor(compressor) -> None:
    """Refuse, before any worker starts, a compressor whose payload is not self-contained."""
    bare = _bare(compressor)
    if getattr(bare, "warmup", False):
        raise ValueError(
            f"compressed gossip needs a payload of fixed layout; {bare.name!r} with warmup=1 changes "
            "how many entries it keeps every stage. Use warmup=0"
        )
    if bare.compress(torch.zeros(8), _fresh_state(bare, torch.zeros(8)), None).shared:
        raise ValueError(
            f"compressed gossip needs a self-contained payload; {bare.name!r} leans on tensors every "
            "rank shares (a shared seed or an agreed scale) that a point-to-point exchange does not "
            "have. Use topkq, dct-topk, topk, randomk or sign"
        )


class EdgeEstimates:
    """The per-edge public estimates of one node, the payload codec, and the mixing step."""

    def __init__(self, compressor, start: Tensor, gamma: float = 0.3):
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gossip gamma (consensus step size) must be in (0, 1], got {gamma!r}")
        self.compressor = _bare(compressor)
        self.gamma = float(gamma)
        self.start = start.detach().to(torch.float32).clone()
        self.edges: dict[tuple[int, int], Tensor] = {}
        check_compressor(self.compressor)
        zeros = torch.zeros_like(self.start)
        template = self.compressor.compress(zeros, _fresh_state(self.compressor, zeros), None)
        self.layout = [(t.shape, t.dtype) for t in template.tensors]
        self.meta = dict(template.meta)
        self.nbytes = sum(t.numel() * t.element_size() for t in template.tensors)

    # ---- payloads as bytes ---------------------------------------------------------------------------
    def _pack(self, payload: Payload) -> Tensor:
        parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in payload.tensors]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)

    def _unpack(self, data: Tensor) -> Payload:
        tensors, at = [], 0
        for shape, dtype in self.layout:
            n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            tensors.append(data[at : at + n].clone().view(dtype).reshape(shape))  # clone: aligned for the view
            at += n
        return Payload(tensors, self.start.shape, torch.float32, meta=dict(self.meta))

    def like(self) -> Tensor:
        """What one received payload looks like (for Comm.exchange)."""
        return torch.zeros(self.nbytes, dtype=torch.uint8)

    # ---- one round ----------------------------------------------------------------------------------
    def estimate(self, src: int, dst: int) -> Tensor:
        if (src, dst) not in self.edges:
            self.edges[(src, dst)] = self.start.clone()
        return self.edges[(src, dst)]

    def outgoing(self, me: int, x: Tensor, send_to: list[int]) -> dict[int, Tensor]:
        """The payload for each out-peer; this node's copy of each out-edge estimate moves with it."""
        out = {}
        for p in send_to:
            h = self.estimate(me, p)
            payload = self.compressor.compress(x - h, self.compressor.state(f"edge {me}->{p}", x), None)
            h += self.compressor.decompress(payload).to(torch.float32).reshape(-1)
            out[p] = self._pack(payload)
        return out

    def incoming(self, me: int, got: dict[int, Tensor]) -> None:
        for j in sorted(got):  # fixed order: the same bits whatever order the messages came in
            self.estimate(j, me).add_(self.compressor.decompress(self._unpack(got[j])).to(torch.float32).reshape(-1))

    def mixed(self, me: int, x: Tensor, send_to: list[int], recv_from: list[int]) -> Tensor:
        pull = torch.zeros_like(x)
        for j in sorted(recv_from):
            pull += self.edges[(j, me)]
        for q in sorted(send_to):
            pull -= self.edges[(me, q)]
        return x + pull.mul_(self.gamma / (1 + len(recv_from)))

    # ---- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "start": self.start.clone(),
            "edges": {f"{s}->{d}": h.clone() for (s, d), h in self.edges.items()},
            "compressor": self.compressor.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        start = state["start"]
        if start.numel() != self.start.numel():
            raise ValueError(
                f"gossip: checkpointed edge estimates have {start.numel()} values, the model has "
                f"{self.start.numel()}; was it saved for another model?"
            )
        self.start = start.to(torch.float32).clone()
        self.edges = {}
        for key, h in state["edges"].items():
            s, d = (int(v) for v in key.split("->"))
            self.edges[(s, d)] = h.to(torch.float32).clone()
        self.compressor.load_state_dict(state["compressor"])
