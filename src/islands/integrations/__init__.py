"""islands inside the trainers people already use (issue #35; docs/frameworks.md).

Each island is an ordinary job of its framework (its own torchrun or `accelerate launch`, DDP inside over its own
default process group); an outer strategy runs across islands from the framework's own hooks:

- islands.integrations.transformers.IslandsCallback: a Hugging Face `TrainerCallback`;
- islands.integrations.lightning.IslandsCallback: a PyTorch Lightning `Callback`;
- `OuterRun` (here): the same for any loop, accelerate's or a plain torchrun script's.

The submodules import their framework; this package and `islands` itself do not (the frameworks are extras).
"""

from islands.integrations.outer_run import OuterRun

__all__ = ["OuterRun"]
