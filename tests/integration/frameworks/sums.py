"""The frameworks' scripts' data: rows of 8 normal values whose label is their sum, seeded per island (a task any
small network learns in a few hundred steps, with nothing to download)."""

import torch
from torch.utils.data import Dataset


class Sums(Dataset):
    def __init__(self, seed: int, rows: int = 2048):
        self.x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.x[i].sum(-1, keepdim=True)}
