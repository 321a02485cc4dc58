"""Inner optimizers islands adds to torch's (public names).

    MuonAdamW(muon_params, adamw_params, lr=..., weight_decay=...)   torch.optim.Muon on hidden matrices, AdamW on
                                                                     the rest, one optimizer (islands.optim.muon)
    MuonAdamW.for_model(model, lr=...)                               split by muon_split(model)
    muon_split(model, head=None) -> (muon_params, adamw_params)      the split: linear weights but the head -> Muon

MuLoCo (DiLoCo with Muon inside) is `islands.outer.DiLoCo` around a model trained with MuonAdamW, or
`islands train --optimizer muon --outer diloco:...` (docs/outer-strategies.md, "MuLoCo").
"""

from islands.optim.muon import MuonAdamW, muon_split

__all__ = ["MuonAdamW", "muon_split"]
