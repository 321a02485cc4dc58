"""Muon for the hidden weight matrices, AdamW for everything else, as one torch optimizer.

torch.optim.Muon (torch >= 2.9) orthogonalises each 2-D update with a few Newton-Schulz iterations; it refuses
any parameter that is not 2-D, and the practice around it (Keller Jordan's Muon post, 2024; Liu et al. 2025,
"Muon is Scalable for LLM Training", arXiv:2502.16982) gives it only the hidden layers' matrices: embeddings, the
output head, biases and norm gains stay with AdamW. `MuonAdamW` holds both halves as parameter groups of one
`torch.optim.Optimizer`, so the Trainer's lr schedule (each group's lr times the schedule's factor), the
strategies' step hooks, zero_grad, state_dict / load_state_dict and islands' checkpoints treat it as any other
optimizer. Each group carries `kind` ("muon" or "adamw"); a step runs torch's own Muon over the muon groups and
torch's own AdamW over the others, on the one shared `state`.

    muon, rest = muon_split(model)                      # which parameters go where (rule below)
    opt = MuonAdamW(muon, rest, lr=3e-3, weight_decay=0.1)
    opt = MuonAdamW.for_model(model, lr=3e-3)           # the same, split by muon_split
    islands train --optimizer muon                      # the same through the CLI (train.optimizer)

The split (`muon_split`): Muon gets the weight of every `nn.Linear` (and of transformers' GPT-2 `Conv1D`, a
transposed linear) except the output head; AdamW gets the rest, including 2-D tables that are not a linear map's
weight (nn.Embedding, positional tables held as a bare nn.Parameter) and any weight tied to an embedding. The head
is, unless named, the last linear module in `model.named_modules()` order (the output layer of the built-in
models, of transformers' LM heads and of torchvision classifiers).

Defaults and where they come from:
- `adjust_lr_fn="match_rms_adamw"` (torch's name for Liu et al.'s rule): a matrix of shape A x B steps with
  lr x 0.2 x sqrt(max(A, B)), which gives Muon's orthogonalised update about the RMS of an AdamW update (0.2 to
  0.4 in their measurements), so the job's AdamW lr and weight decay carry over unchanged (their finding, which
  we rely on rather than retune). torch's own default, "original" (Keller Jordan's sqrt(max(1, A/B))), wants a
  Muon lr of about 0.02, an order of magnitude above AdamW's; pass `muon_lr_ratio` with it.
- `momentum=0.95`, `nesterov=True`, `ns_steps=5`: Keller Jordan's values, which are also torch.optim.Muon's
  defaults; so are the Newton-Schulz coefficients, which we leave to torch.
- `weight_decay`: decoupled, the same value for both halves (Liu et al. apply AdamW's to Muon's matrices too).
- `betas`, `eps`: AdamW's, for the AdamW half only. That half is torch's fused AdamW when all its parameters are on
  CUDA (islands.optim.fused).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from islands.optim.fused import fused_adamw

KINDS = ("muon", "adamw")
ADJUST_LR = ("match_rms_adamw", "original")


def _is_matrix_module(module: nn.Module) -> bool:
    """A linear map with a 2-D weight: nn.Linear, or transformers' Conv1D (GPT-2's linear with a transposed weight)."""
    weight = getattr(module, "weight", None)
    return (
        (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D")
        and isinstance(weight, nn.Parameter)
        and weight.ndim == 2
    )


def muon_split(
    model: nn.Module, head: str | Sequence[str] | None = None
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(parameters for Muon, parameters for AdamW), each parameter once, in the model's parameter order.

    Muon: the weight of every linear module except the head. AdamW: everything else (biases, norms, embeddings,
    positional tables, convolutions, the head, and weights tied to an embedding). `head`: the qualified name(s)
    of the output module(s) to keep on AdamW; None = the last linear module in named_modules() order; () = none.
    """
    linear = [(name, m) for name, m in model.named_modules() if _is_matrix_module(m)]
    if head is None:
        heads = {linear[-1][0]} if linear else set()
    else:
        heads = {head} if isinstance(head, str) else set(head)
        known = {name for name, _ in model.named_modules()}
        unknown = sorted(heads - known)
        if unknown:
            raise ValueError(
                f"muon_split: head {unknown} names no module of {type(model).__name__}; "
                f"its linear modules are {[n for n, _ in linear]}"
            )
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    to_muon = {id(m.weight) for name, m in linear if name not in heads and id(m.weight) not in embedded}
    muon: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for p in model.parameters():  # deduplicated: a tied weight appears once
        (muon if id(p) in to_muon else rest).append(p)
    return muon, rest


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over `muon_params` (2-D hidden weight matrices) and torch.optim.AdamW over `adamw_params`,
    as one optimizer with one state (see the module docstring for the split and the defaults).

    `lr`: the peak lr of both halves (with adjust_lr_fn="match_rms_adamw" Muon's effective per-matrix lr is
    lr x 0.2 x sqrt(max(A, B))). `muon_lr_ratio`: Muon's lr over `lr` (1 with match_rms_adamw). `weight_decay`:
    decoupled, both halves. `betas`, `eps`: AdamW's. `momentum`, `nesterov`, `ns_steps`, `adjust_lr_fn`: Muon's.
    """

    def __init__(
        self,
        muon_params: Iterable[nn.Parameter],
        adamw_params: Iterable[nn.Parameter],
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str = "match_rms_adamw",
        muon_lr_ratio: float = 1.0,
    ):
        muon_params, adamw_params = list(muon_params), list(adamw_params)
        if not muon_params and not adamw_params:
            raise ValueError("MuonAdamW got no parameters")
        if adjust_lr_fn not in ADJUST_LR:
            raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR}, got {adjust_lr_fn!r}")
        if not muon_lr_ratio > 0:
            raise ValueError(f"muon_lr_ratio must be > 0, got {muon_lr_ratio}")
        flat = [p for p in muon_params] + [p for p in adamw_params]
        if len({id(p) for p in flat}) != len(flat):
            raise ValueError("MuonAdamW: a parameter is given twice (to both halves, or twice to one)")
        bad = [tuple(p.shape) for p in muon_params if p.ndim != 2]
        if bad:
            raise ValueError(f"Muon takes 2-D weight matrices only; got shapes {bad} (give those to AdamW)")
        children: dict[str, torch.optim.Optimizer] = {}
        if muon_params:
            children["muon"] = torch.optim.Muon(
                muon_params,
                lr=lr * muon_lr_ratio,
                weight_decay=weight_decay,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                adjust_lr_fn=adjust_lr_fn,
            )
        if adamw_params:
            children["adamw"] = torch.optim.AdamW(
                adamw_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused_adamw(adamw_params)
            )
        groups = []
        for kind, child in children.items():
            for group in child.param_groups:
                group["kind"] = kind
                groups.append(group)
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})
        self._children = children

    @classmethod
    def for_model(cls, model: nn.Module, head: str | Sequence[str] | None = None, **kwargs) -> MuonAdamW:
        """MuonAdamW over `model`'s parameters, split by muon_split(model, head)."""
        muon, rest = muon_split(model, head)
        return cls(muon, rest, **kwargs)

    def _child(self, kind: str) -> torch.optim.Optimizer | None:
        """torch's optimizer for one kind, pointed at this optimizer's groups of that kind and at the shared
        state (load_state_dict and unpickling replace both, so the link is made again at every step)."""
        groups = [g for g in self.param_groups if g.get("kind") == kind]
        if not groups:
            return None
        children = self.__dict__.setdefault("_children", {})
        child = children.get(kind)
        if child is None:  # an unpickled optimizer: torch's class again, its groups and state are ours below
            cls = torch.optim.Muon if kind == "muon" else torch.optim.AdamW
            child = children[kind] = cls([p for g in groups for p in g["params"]])
        child.param_groups = groups
        child.state = self.state
        return child

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for kind in KINDS:
            child = self._child(kind)
            if child is not None:
                child.step()
        return loss
