"""Any islands.compress compressor that stands alone on one island's vector, for the parameter server's pushes
(issue #36 item 1): a PayloadCodec adapter, so the links, the server loop and the shard servers carry and decode its
payloads as they carry Quant4's.

    ParameterServer(50, compressor=TopKQ(ratio=0.01, bits=2))
    make_outer("ps:inner_steps=50,compressor=(topkq:ratio=0.01,bits=2)")

Where each half runs. `encode` runs on the island: the compressor's compress, inside its error feedback where it asks
for it (`ef`, with_error_feedback, as DiLoCo's exchange runs it), one residual per server range (thread mode: one
range, the whole vector; servers=S: S ranges, each encoded on its own, `encode_part`). The residual carries into the
island's next push and is in its checkpoint (ParameterServer.extra_state, `ps_codec`). A compressor that agrees on
something before compressing (int8/int4's shared scale) agrees within a group of one: the island's own max |x|, and
the levels of one party (int8: 127, int4: 7). `decode` runs on the server: the payload back into the compressor's
Payload and its `decompress`, the dense fp32 delta (sparse payloads are scattered on the server), which the server
applies as it applies an fp32 push.

What travels, per range: one int64 count per payload tensor (the values' count of each, then of each `shared`
tensor: int8's scale), then each tensor's bytes in that order. So a push costs the compressor's own payload_nbytes
plus 8 bytes per tensor (topkq 24, int8 16, randomk 16), plus the link's header. The length depends on the data (top-k
with DGC's warm-up changes k), so the codec is `variable_length`: every link already carries a payload's length.

Refused, with what works named (REFUSED): compressors whose payload means something only beside the other islands'
payloads of the same round. A parameter server applies each island's push alone, when it comes.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from islands.compress.base import Agreed, Compressor, CompressorBase, Payload, check_finite
from islands.compress.error_feedback import ErrorFeedback, with_error_feedback
from islands.compress.powersgd import PowerSGD
from islands.compress.randomk_shared import SharedRandomK
from islands.compress.sign import MajorityVote
from islands.compress.torch_powersgd import TorchPowerSGD
from islands.sync.outer.exchange import Stateful
from islands.sync.outer.quant4 import PayloadCodec

WORKS = "topkq, dct-topk, topk, randomk, qsgd, int8, int4, fp16 or bf16"
# why each compressor cannot compress one island's push on its own (each message one line, naming what works)
REFUSED: tuple[tuple[type, str], ...] = (
    (
        MajorityVote,
        "sign decides each coordinate by a majority vote over every island's signs in one round; a parameter "
        "server applies each island's push alone, so there is no vote to take",
    ),
    (
        PowerSGD,
        "powersgd factorises each parameter matrix with projections the islands share (P summed over every island "
        "in one round); a push is one island's flat vector, which powersgd would send uncompressed",
    ),
    (
        SharedRandomK,
        "randomk-shared sends values without positions because every island keeps the same positions in the same "
        "round; pushes share no round (randomk sends its positions with its values)",
    ),
    (TorchPowerSGD, "torch-powersgd is torch's DDP gradient hook, not a compressor of a vector"),
)
PROBE = 64  # values of the vector a payload's layout is read from (its tensors' dtypes, its meta)


def round_shared(compressor: object) -> str | None:
    """Why `compressor`'s payload means something only beside other islands' of the same round (REFUSED); None
    when it stands alone on one island's vector."""
    inner = compressor.inner if isinstance(compressor, ErrorFeedback) else compressor
    return next((why for kind, why in REFUSED if isinstance(inner, kind)), None)


def refusal(compressor: object) -> str | None:
    """Why `compressor` cannot compress a parameter server's pushes, in one line; None when it can."""
    why = round_shared(compressor)
    return None if why is None else f"ps: compressor {why}: use {WORKS}"


def push_codec(compressor: object) -> PayloadCodec | None:
    """What a ParameterServer's pushes use for `compressor`: None (fp32), a PayloadCodec as given (Quant4,
    Quant4Zstd), or an islands.compress compressor as CompressedPushes. ValueError for a refused one (REFUSED),
    TypeError for anything else."""
    if compressor is None or isinstance(compressor, PayloadCodec):
        return compressor
    why = refusal(compressor)
    if why is not None:
        raise ValueError(why)
    if not isinstance(compressor, CompressorBase):
        raise TypeError(
            f"ps pushes take an islands.compress compressor or a PayloadCodec (Quant4, Quant4Zstd), got "
            f"{type(compressor).__name__}"
        )
    return CompressedPushes(compressor)


class PayloadBytes:
    """A compressor's payload of one flat fp32 vector as uint8 bytes and back (module docstring: what travels),
    by a layout read once from a probe payload: its tensors' dtypes, how many are payload tensors, its meta. The
    pushes' codec (CompressedPushes) and the compressed pulls (ps_pulls.PullCodec) both travel in it."""

    def __init__(self, compressor: Compressor, name: str):
        self.compressor, self.name = compressor, name  # the compressor decompresses (no per-range state)
        self.layout: tuple[list[torch.dtype], int, dict] | None = None  # (dtypes, payload tensors, meta): probe()

    def probe(self) -> tuple[list[torch.dtype], int, dict]:
        """The payload's layout, which does not depend on the values: its tensors' dtypes (payload tensors, then
        shared), how many are payload tensors, and its meta; read once from a copy's payload of a small vector."""
        if self.layout is None:
            probe = with_error_feedback(copy.deepcopy(self.compressor))
            x = torch.linspace(-1.0, 1.0, PROBE)
            state = probe.state("probe", x)
            payload = probe.compress(x, state, Agreed(probe.agree(x, state), 1))
            tensors = [*payload.tensors, *payload.shared]
            self.layout = ([t.dtype for t in tensors], len(payload.tensors), dict(payload.meta))
        return self.layout

    def pack(self, payload: Payload) -> Tensor:
        tensors = [*payload.tensors, *payload.shared]
        dtypes, count, meta = self.probe()
        # the receiver decodes by the probe's layout: a payload of other dtypes cannot travel (top-k's indices are
        # int64 in a range of 2**31 values or more, int32 in the probe's)
        if [t.dtype for t in tensors] != dtypes or len(payload.tensors) != count or payload.meta != meta:
            raise ValueError(
                f"{self.name}: a payload of {[t.dtype for t in tensors]}, meta {payload.meta} differs from the layout "
                f"the server decodes ({dtypes}, meta {meta}); this compressor's payload cannot travel to a server"
            )
        counts = torch.tensor([t.numel() for t in tensors], dtype=torch.int64).view(torch.uint8)
        return torch.cat([counts, *(t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors)])

    def decode(self, payload: Tensor, numel: int) -> Tensor:
        """The dense fp32 vector of `numel` values that `payload`'s bytes decompress to."""
        dtypes, count, meta = self.probe()
        head = 8 * len(dtypes)
        if payload.dtype != torch.uint8 or payload.numel() < head:
            raise ValueError(f"{self.name}: a payload of {payload.numel()} {payload.dtype} holds no {head}-byte count")
        counts = [int(n) for n in payload[:head].clone().view(torch.int64).tolist()]
        sizes = [n * d.itemsize for n, d in zip(counts, dtypes)]
        if min(counts) < 0 or head + sum(sizes) != payload.numel():
            raise ValueError(
                f"{self.name}: a payload of {payload.numel()} bytes does not hold the {counts} values its count says"
            )
        tensors, at = [], head
        for size, dtype in zip(sizes, dtypes):
            piece = payload[at : at + size]
            aligned = piece.data_ptr() % dtype.itemsize == 0  # a dtype view needs an aligned start: else a copy
            tensors.append((piece if aligned else piece.clone()).view(dtype))
            at += size
        shape = torch.Size([numel])
        whole = Payload(tensors[:count], shape, torch.float32, shared=tensors[count:], meta=dict(meta))
        return self.compressor.decompress(whole).to(torch.float32).reshape(-1)


class CompressedPushes(PayloadCodec):
    """One island's pushes through an islands.compress compressor (module docstring). The island's encoder (the
    compressor in its error feedback, with its state per range) is a copy of its own; the server decodes with
    another, which holds no state, so a server thread of the island's process never reads what the island writes."""

    variable_length = True

    def __init__(self, compressor: Compressor):
        why = refusal(compressor)
        if why is not None:
            raise ValueError(why)
        self.compressor = copy.deepcopy(compressor)  # decodes (decompress reads no per-range state)
        self.name = f"ps({compressor.name})"
        self.wire = PayloadBytes(self.compressor, self.name)
        # built here so that a refused error feedback (randomk, qsgd with ef=1) fails at once, not at the first push
        self.encoder: Compressor | None = self.fresh_encoder()

    def fresh_encoder(self) -> Compressor:
        return with_error_feedback(copy.deepcopy(self.compressor))

    def __getstate__(self) -> dict:
        # the server processes' configuration pickles this codec: they decode only, and the island's residuals
        # (and its compressor's generators) stay on the island
        return {**self.__dict__, "encoder": None}

    # ---- the island's side --------------------------------------------------------------------------------
    def encode(self, x: Tensor) -> Tensor:
        return self.encode_part(x, 0)

    def encode_part(self, x: Tensor, part: int) -> Tensor:
        """Range `part`'s delta as uint8 bytes, its residual (where error feedback runs) updated for the next push."""
        flat = x.detach().to(torch.float32).reshape(-1).contiguous()
        name = f"range{part}"
        check_finite(name, flat, where="ps push")  # a NaN in a residual would ride on every later push
        if self.encoder is None:
            self.encoder = self.fresh_encoder()
        enc = self.encoder
        state = enc.state(name, flat)
        state["_finite"] = True  # checked above: error feedback need not check again
        payload = enc.compress(flat, state, Agreed(enc.agree(flat, state), 1))  # agreed within a group of one
        return self.wire.pack(payload)

    # ---- the server's side --------------------------------------------------------------------------------
    def decode(self, payload: Tensor, numel: int) -> Tensor:
        return self.wire.decode(payload, numel)

    # ---- the island's checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The encoder's state: each range's residual, the compressor's own (top-k's step, random-k's generator)."""
        return {"encoder": self.encoder.state_dict()} if isinstance(self.encoder, Stateful) else {}

    def load_state_dict(self, state: dict) -> None:
        if "encoder" not in state:
            return
        self.encoder = self.fresh_encoder()
        assert isinstance(self.encoder, Stateful), "a compressor's encoder has a state_dict"
        self.encoder.load_state_dict(state["encoder"])


def codec_state(codec: PayloadCodec | None) -> dict:
    """What an island's checkpoint keeps of its pushes' codec: a compressor's residuals (`ps_codec`); {} for a
    stateless one (Quant4)."""
    return {"ps_codec": codec.state_dict()} if isinstance(codec, Stateful) else {}


def load_codec_state(codec: PayloadCodec | None, state: dict) -> None:
    if isinstance(codec, Stateful) and "ps_codec" in state:
        codec.load_state_dict(state["ps_codec"])
