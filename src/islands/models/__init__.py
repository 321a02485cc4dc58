"""Small reference models: a byte-level causal transformer and an MLP for digits."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from islands.memory.recompute import run_checkpointed, split_segments

# The built-in tasks' models, public so that a user's task or a benchmark can build the same ones.
__all__ = ["Block", "ByteTransformer", "MLP", "count_parameters", "sequence_loss"]


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ByteTransformer(nn.Module):
    """GPT-style causal transformer over raw bytes (vocabulary 256)."""

    def __init__(self, d_model: int = 128, n_layers: int = 4, n_heads: int = 4, context: int = 128):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(256, d_model)
        self.pos = nn.Parameter(torch.zeros(context, d_model))
        blocks = [Block(d_model, n_heads) for _ in range(n_layers)]
        self.blocks = nn.ModuleList(blocks)
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 256, bias=False)
        self.checkpoint_segments = 0  # 0 = hold every activation; k > 0 = recompute in k segments (SOTA-249)
        self.apply(self._init)
        for b in blocks:  # scale residual projections by depth (GPT-2 convention)
            for lin in (b.proj, b.out):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * n_layers))

    def set_activation_checkpointing(self, segments: int) -> None:
        """0 turns it off; k in 1..n_layers recomputes the blocks in k segments during backward."""
        if segments:
            split_segments(self.blocks, segments)  # raises a clear ValueError for a bad count
        self.checkpoint_segments = segments

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"sequence length {t} exceeds the model's context {self.context}")
        x = self.embed(idx) + self.pos[:t]
        if self.checkpoint_segments and self.training and torch.is_grad_enabled():
            x = run_checkpointed(self.blocks, x, self.checkpoint_segments)
        else:
            for b in self.blocks:
                x = b(x)
        return self.head(self.ln(x))


class MLP(nn.Module):
    def __init__(self, inputs: int = 64, hidden: int = 128, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def sequence_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
