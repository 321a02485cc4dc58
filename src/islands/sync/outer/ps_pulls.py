"""Compressed pulls (issue #36 item 1): the parameter server's answers carry a compressed step from the model the
island holds to the global model, instead of the whole fp32 model.

    ParameterServer(50, pulls=islands.compress.COMPRESSORS.build("int8"))
    make_outer("ps:inner_steps=50,pulls=(topkq:ratio=0.05,bits=4)")

The rule (EF21-P's primal compression, arXiv 2209.15218, on the server's side of the link): the server keeps, per
island and per server range, the copy of the model it knows that island holds, and answers with
payload = C(global - copy); both ends then add the payload's decoded vector to their copy, by the same code on the
same bytes, so the two copies stay equal bit for bit. What C left out stays in global - copy and goes out with the
next answer: the copy is the error feedback, and the server keeps no residual of its own. The island trains from its
copy (its round's pseudo-gradient is copy - local, which the server applies to the global model as any push).

Which answers are whole (fp32, flagged as such): an island's first pull, a restarted island's (a new process holds
nothing), any answer to an island whose request names a copy the server does not hold (an answer lost on the way,
or a server rebuilt from its journal or restored from a checkpoint: the copies are not journaled, so each island's
next answer after a rebuild is whole), and every DONE's (the job ends on one exact model). Each copy carries a
random 52-bit token; the island names the token of the copy it holds in every request, and the server answers with
a step only from a copy under that token. An island that is done, left or lapsed loses its copy (a lapsed one that
wakes gets a whole answer), so the server holds at most one copy per live island.

Which compressors: any that C(x) leaves closer to x than x is to zero (`contractive`): topkq, dct-topk, topk,
int8, int4, fp16, bf16. randomk and qsgd rescale to stay unbiased and can send more than the gap (the copies would
swing); sign, powersgd and randomk-shared need other islands' payloads of the same round (ps_codecs.REFUSED). The
pull's compressor runs bare: error feedback (and top-k's DGC momentum, which rides on its residual) is the copy's.
"""

from __future__ import annotations

import copy
import secrets
from dataclasses import dataclass

import torch
from torch import Tensor

from islands.compress.base import Agreed, Compressor, CompressorBase
from islands.sync.outer.ps_codecs import PayloadBytes, round_shared

PULL_WORKS = "topkq, dct-topk, topk, int8, int4, fp16 or bf16"


def pull_refusal(compressor: object) -> str | None:
    """Why `compressor` cannot compress the parameter server's pulls, in one line; None when it can."""
    why = round_shared(compressor)
    if why is not None:
        return f"ps: pulls= {why}: use {PULL_WORKS}"
    if not isinstance(compressor, CompressorBase):
        return f"ps: pulls= takes an islands.compress compressor ({PULL_WORKS}), got {type(compressor).__name__}"
    if not compressor.contractive:
        return (
            f"ps: pulls={compressor.name} rescales its values to stay unbiased, so a pull can overshoot the gap "
            f"between the island's model and the global one and the copies would swing: use {PULL_WORKS}"
        )
    return None


def pull_codec(compressor: Compressor | None) -> PullCodec | None:
    """The pulls' codec for `compressor` (None: whole fp32 pulls). ValueError naming what works for a refused one."""
    if compressor is None:
        return None
    why = pull_refusal(compressor)
    if why is not None:
        raise ValueError(why)
    return PullCodec(compressor)


def fresh_token() -> int:
    """A copy's token: random, so a server rebuilt without its copies never names an old copy by chance; below 2**52,
    so a float64 header carries it exactly; never 0 (an island that holds nothing)."""
    return secrets.randbits(52) | 1


class PullCodec:
    """The compressor both ends of a pull run: `encode` on the server, `step` on both (module docstring)."""

    def __init__(self, compressor: Compressor):
        self.compressor = copy.deepcopy(compressor)
        self.name = f"ps pulls ({compressor.name})"
        self.wire = PayloadBytes(self.compressor, self.name)
        self.encoders: dict[str, Compressor] = {}  # per island and range: the compressor's own state (top-k's step)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "encoders": {}}  # a server process builds its own

    def encode(self, gap: Tensor, name: str) -> Tensor:
        """C(gap) as uint8 bytes; `name` keeps the compressor's state (a step count) per island and range."""
        flat = gap.detach().to(torch.float32).reshape(-1).contiguous()
        enc = self.encoders.get(name)
        if enc is None:
            enc = self.encoders[name] = copy.deepcopy(self.compressor)
        state = enc.state("pull", flat)
        return self.wire.pack(enc.compress(flat, state, Agreed(enc.agree(flat, state), 1)))  # a group of one

    def step(self, held: Tensor, payload: Tensor) -> Tensor:
        """The copy after a pull: `held` plus what `payload` decodes to (a new tensor; the same bits on both ends)."""
        return held + self.wire.decode(payload, held.numel())

    def forget(self, name: str) -> None:
        self.encoders.pop(name, None)


WHOLE = 0  # the token of an island that holds no copy the server gave it: its next answer is whole


@dataclass(frozen=True)
class Pulled:
    """A model as an answer carries it: `body` is the whole fp32 model (coded False) or a PullCodec payload (coded
    True), and `token` names the copy the island holds once it has taken it."""

    body: Tensor
    token: int = WHOLE
    coded: bool = False


class HeldCopies:
    """The server's side, for one range of the model: each live island's copy and its token. Not thread safe: the
    caller holds the lock it applies messages under."""

    def __init__(self, codec: PullCodec | None, part: int = 0):
        self.codec, self.part = codec, part
        self.copies: dict[int, tuple[int, Tensor]] = {}  # island -> (token, the model it holds)
        self.whole = self.coded = 0  # answers of each kind (the servers' report)
        self.peak_bytes = 0  # the copies' bytes at their largest (server memory the pulls add)

    def answer(self, island: int, token: int, flat: Tensor) -> Pulled:
        """The answer's model for `island`, which says it holds the copy under `token`: a step from that copy, or
        the whole model when the server holds no such copy (or pulls are not compressed)."""
        if self.codec is None:
            return Pulled(flat)
        held = self.copies.get(island)
        new = fresh_token()
        if held is None or token == WHOLE or held[0] != token:
            self.copies[island] = (new, flat.detach().to(torch.float32).clone())
            self.whole += 1
            self.peak_bytes = max(self.peak_bytes, sum(c.numel() * 4 for _, c in self.copies.values()))
            return Pulled(flat, new, coded=False)
        payload = self.codec.encode(flat - held[1], f"{island}/{self.part}")
        self.copies[island] = (new, self.codec.step(held[1], payload))
        self.coded += 1
        return Pulled(payload, new, coded=True)

    def forget(self, island: int) -> None:
        """`island` is done, left or lapsed: its copy goes (a later request of it gets a whole answer)."""
        self.copies.pop(island, None)
        if self.codec is not None:
            self.codec.forget(f"{island}/{self.part}")

    def forget_all(self) -> None:
        """The global model was put back (a restore): no island holds a copy of it, every next answer is whole."""
        for island in list(self.copies):
            self.forget(island)

    def report(self) -> dict:
        return {"whole": self.whole, "coded": self.coded, "copies": len(self.copies), "peak_bytes": self.peak_bytes}


class HeldModel:
    """The island's side, for one range: the model it holds from its last answer and that copy's token."""

    def __init__(self, codec: PullCodec | None):
        self.codec = codec
        self.token = WHOLE
        self.model: Tensor | None = None

    def take(self, pulled: Pulled) -> Tensor:
        """The model an answer brings: its whole fp32 body, or the held copy stepped by its payload."""
        if not pulled.coded:
            model = pulled.body.detach().to(torch.float32).reshape(-1)
        else:
            if self.codec is None or self.model is None:
                holds = "no copy" if self.model is None else "no pull codec"
                raise ValueError(
                    "the parameter server answered with a compressed pull that this island cannot apply: it holds "
                    f"{holds} (the servers and islands disagree on pulls=)"
                )
            model = self.codec.step(self.model, pulled.body)
        self.token, self.model = (pulled.token, model) if self.codec is not None else (WHOLE, None)
        return model

    def drop(self) -> None:
        """Forget the copy (a connection that broke mid-answer): the next answer is whole."""
        self.token, self.model = WHOLE, None
