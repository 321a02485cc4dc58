"""Models islands did not write, small enough for unit tests through the public API: a `transformers` GPT-2 built
from a config (its forward returns a ModelOutput, whose logits the Trainer hands to the loss) with random token data,
and a two-layer module of the user's own with a separable classification task (for torch.compile)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset


def tiny_gpt2() -> nn.Module:
    """A one-layer GPT-2 over a 64-token vocabulary, seeded (the caller skips without transformers)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, use_cache=False, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(cfg)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tokens() -> TensorDataset:
    """64 sequences of 12 random tokens and their next tokens."""
    ids = torch.randint(0, 64, (64, 13), generator=torch.Generator().manual_seed(1))
    return TensorDataset(ids[:, :-1], ids[:, 1:])


class SmallNet(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.a, self.b = nn.Linear(8, hidden), nn.Linear(hidden, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def small_net(hidden: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return SmallNet(hidden)


def rows() -> TensorDataset:
    """96 rows of 8 features, labelled by the argmax of a fixed random projection to 4 classes."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(96, 8, generator=g)
    return TensorDataset(x, (x @ torch.randn(8, 4, generator=g)).argmax(-1))
