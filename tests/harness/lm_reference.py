"""The one-process reference the multi-rank LM tests compare against: fixed batches, plain training.

Each test file keeps its own sizes and optimizer; the batches and the reference loop are the same
code everywhere, so every 'equals one process on the concatenated batch' claim is checked the same way.
"""

from __future__ import annotations

import torch

from islands.models import sequence_loss


def lm_batches(rows: int, context: int, steps: int, seed: int) -> list[torch.Tensor]:
    """`steps` global batches of `rows` byte sequences (context + 1 tokens: inputs and shifted targets)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (rows, context + 1), generator=g) for _ in range(steps)]


def train_reference(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches) -> torch.nn.Module:
    """One process, every global batch whole: what the distributed runs must reproduce."""
    for b in batches:
        sequence_loss(model(b[:, :-1]), b[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model
