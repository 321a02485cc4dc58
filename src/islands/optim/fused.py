"""Whether islands' AdamW asks torch for its fused kernel (issue #34 item 2: fast kernels on the GPU path).

torch 2.13 has fused AdamW kernels for CUDA and also for the CPU, MPS and XPU
(torch.utils._foreach_utils._get_fused_kernels_supported_devices). islands asks for them on CUDA only. There one
fused kernel does the whole update where the default (foreach) path runs a multi-tensor kernel per operation. On the
CPU the fused kernel's arithmetic differs from the default path's in the last bit (1.2e-7 apart after 20 steps,
torch 2.13), and CPU runs are compared bit for bit with earlier ones, so the CPU keeps torch's default.
"""

from __future__ import annotations

import torch


def _tensors(item) -> list[torch.Tensor]:
    if not isinstance(item, dict):
        return [item]
    group = item["params"]
    return [group] if isinstance(group, torch.Tensor) else list(group)


def fused_adamw(params: list) -> bool | None:
    """`fused=` for torch.optim.AdamW over `params` (tensors or parameter groups, in a list: a generator would be
    used up here): True when every parameter is on CUDA, else None (torch's own choice)."""
    tensors = [t for item in params for t in _tensors(item)]
    return True if tensors and all(t.device.type == "cuda" for t in tensors) else None
