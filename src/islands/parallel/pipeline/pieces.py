"""A model as an ordered list of pieces, and a pipeline stage as a contiguous run of them.

A piece is the smallest unit a stage boundary may fall between: exactly one tensor flows from one piece
to the next, so a cut between pieces sends that one tensor forward and its gradient back (LIT-016).
Cuts inside a transformer block would have to send the residual stream and a sublayer's output, so a
block is one piece. Pieces share their parameters with the original model: a stage trains the very
tensors the full model holds, and the full model is what evaluation and checkpoints see.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn

from islands.models import MLP, ByteTransformer
from islands.parallel.pipeline.hf_pieces import causal_lm_pieces, is_causal_lm


class TokenEmbedding(nn.Module):
    """The byte transformer's entry: token embedding plus the learned position table."""

    def __init__(self, model: ByteTransformer):
        super().__init__()
        self.embed = model.embed
        self.pos = model.pos  # the same Parameter object as the model's, not a copy
        self.context = model.context

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"sequence length {t} exceeds the model's context {self.context}")
        return self.embed(idx) + self.pos[:t]


class OutputHead(nn.Module):
    """The byte transformer's exit: final LayerNorm and the logits projection."""

    def __init__(self, model: ByteTransformer):
        super().__init__()
        self.ln, self.head = model.ln, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(x))


def _sequential_pieces(seq: nn.Sequential) -> list[nn.Module]:
    """Each parameter-owning layer together with the parameter-free layers that follow it (Linear+ReLU)."""
    groups: list[list[nn.Module]] = []
    for layer in seq:
        owns = any(True for _ in layer.parameters())
        if owns or not groups:
            groups.append([layer])
        else:
            groups[-1].append(layer)
    return [g[0] if len(g) == 1 else nn.Sequential(*g) for g in groups]


def pieces_of(model: nn.Module) -> list[nn.Module]:
    """The ordered pieces of one of our reference models, any nn.Sequential, or a transformers causal LM; running
    them in order computes exactly model(x) (the LM's logits)."""
    if isinstance(model, ByteTransformer):
        return [TokenEmbedding(model), *model.blocks, OutputHead(model)]
    if isinstance(model, MLP):
        return _sequential_pieces(model.net)
    if isinstance(model, nn.Sequential):
        return _sequential_pieces(model)
    if is_causal_lm(model):  # a transformers GPT-2 or Llama-like causal LM (hf_pieces.py)
        return causal_lm_pieces(model)
    raise TypeError(
        f"cannot split {type(model).__name__} into pipeline pieces; pass a ByteTransformer, an MLP, "
        "an nn.Sequential or a transformers GPT-2 / Llama-like causal LM, or build the list of pieces "
        "yourself"
    )


class Stage(nn.Module):
    """Pieces [start, stop) of a model, run in order: one pipeline stage."""

    def __init__(self, pieces: list[nn.Module], start: int, stop: int, index: int, count: int):
        super().__init__()
        if not 0 <= start < stop <= len(pieces):
            raise ValueError(f"stage {index}: pieces [{start}, {stop}) is not a non-empty range of 0..{len(pieces)}")
        self.pieces = nn.ModuleList(pieces[start:stop])
        self.start, self.stop, self.index, self.count = start, stop, index, count

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for piece in self.pieces:
            x = piece(x)
        return x


def check_starts(starts: list[int], pieces: int) -> None:
    """Stage start indices must begin at 0 and rise strictly inside 0..pieces-1."""
    if not starts or starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)) or starts[-1] >= pieces:
        raise ValueError(
            f"stage starts {starts} must begin at 0 and rise strictly below {pieces} pieces, "
            f"e.g. [0, {pieces // 2}] for two stages"
        )


def build_stages(pieces: list[nn.Module], starts: list[int]) -> list[Stage]:
    """Every stage of the pipeline; stage s runs pieces[starts[s]:starts[s+1]]."""
    check_starts(starts, len(pieces))
    stops = starts[1:] + [len(pieces)]
    return [Stage(pieces, a, b, i, len(starts)) for i, (a, b) in enumerate(zip(starts, stops))]


def parameter_owner(stages: list[Stage]) -> dict[int, int]:
    """id(parameter) -> index of the one stage that holds it; a parameter in two stages is an error."""
    owner: dict[int, int] = {}
    for stage in stages:
        for p in stage.parameters():
            if id(p) in owner and owner[id(p)] != stage.index:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} sits in stages {owner[id(p)]} and "
                    f"{stage.index}; tied weights across stages are not supported"
                )
            owner[id(p)] = stage.index
    return owner
