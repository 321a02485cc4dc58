"""Your model and data behind `islands train`: every strategy, compressor, aggregator, attack, checkpoint level
and --elastic the CLI offers then works with them.

    islands train --task examples/cli_task.py:make_task --workers 4 --islands 2 --outer diloco:inner_steps=20
    islands train --task examples.cli_task:make_task --workers 2 --compress powersgd:rank=2

`make_task(config)` gets the job's config (sections task, train, world, ...; `[task.options]` holds free keys)
and returns an islands.Task. The training data here is a Dataset: islands shards it per worker and
checkpoints its position.
"""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

import islands


class SmallCNN(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.conv = nn.Conv2d(1, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.head = nn.Linear(width * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.head(x.flatten(1)), x  # a tuple: the prediction first


def make_task(config) -> islands.Task:
    d = load_digits()
    order = np.random.default_rng(0).permutation(len(d.target))
    x = torch.tensor(d.images[order] / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target[order])
    width = int(config.task.options.get("width", 16))
    return islands.Task(
        model=SmallCNN(width),
        loss_fn=F.cross_entropy,
        train_data=TensorDataset(x[:1500], y[:1500]),
        val_data=[(x[1500:], y[1500:])],
        classes=10,
        name="digits-cnn",
    )
