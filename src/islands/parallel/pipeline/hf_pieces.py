"""A transformers causal LM as pipeline pieces: the embedding, each decoder layer, the final norm and head.

Two layouts cover the families islands builds (docs/hf-models.md):
  GPT-2      model.transformer.{wte, wpe, drop, h[i], ln_f}, model.lm_head; positions are a learned table
  Llama-like model.model.{embed_tokens, layers[i], norm, rotary_emb}, model.lm_head (Llama, Qwen2, Mistral, ...);
             positions are rotary, so each layer piece recomputes the rotary (cos, sin) for its sequence from
             the model's parameter-free rotary module instead of receiving them from the previous stage
Each layer piece calls the model's own layer with no attention mask: the run is a plain causal window of a
fixed length (no padding), for which sdpa attention masks causally by itself (eager attention does not, so it
is refused). That the
pieces reproduce the model's logits is tested for each family and attention implementation; a layout this
module does not know raises TypeError naming both. Tied input and output embeddings would put one parameter in
the first and the last stage, which a pipeline cannot hold (the model must be built with
tie_word_embeddings=False; the app checks it before any worker starts).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

# attention implementations that mask causally by themselves when given no mask: sdpa does (is_causal); eager
# does not (measured with transformers 5.24: logits off by 0.05-0.08 on tiny GPT-2, Llama and Qwen2 configs)
CAUSAL_WITHOUT_MASK = ("sdpa",)


def is_causal_lm(model: nn.Module) -> bool:
    """A transformers causal LM of a layout below (duck-typed: islands' parallel layer does not import transformers)."""
    return hasattr(model, "config") and hasattr(model, "lm_head") and (_gpt2(model) or _llama_like(model))


def _gpt2(model) -> bool:
    t = getattr(model, "transformer", None)
    return t is not None and all(hasattr(t, k) for k in ("wte", "wpe", "h", "ln_f"))


def _llama_like(model) -> bool:
    m = getattr(model, "model", None)
    return m is not None and all(hasattr(m, k) for k in ("embed_tokens", "layers", "norm", "rotary_emb"))


def _tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _positions(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


class GPT2Embedding(nn.Module):
    def __init__(self, t):
        super().__init__()
        self.wte, self.wpe, self.drop = t.wte, t.wpe, t.drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.wte(ids) + self.wpe(_positions(ids)))


class GPT2Layer(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _tensor(self.block(x))


class TokenEmbedding(nn.Module):
    def __init__(self, embed):
        super().__init__()
        self.embed = embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)


class RotaryLayer(nn.Module):
    """One decoder layer of a rotary-position model; (cos, sin) recomputed here for the window's positions."""

    def __init__(self, layer, rotary):
        super().__init__()
        self.layer = layer
        self._rotary = [rotary]  # in a list: shared and parameter-free, not a submodule of every stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = _positions(x)
        return _tensor(self.layer(x, position_ids=pos, position_embeddings=self._rotary[0](x, pos)))


class NormHead(nn.Module):
    def __init__(self, norm, head):
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


def causal_lm_pieces(model: nn.Module) -> list[nn.Module]:
    attn = getattr(model.config, "_attn_implementation", None) or "unset"
    if attn not in CAUSAL_WITHOUT_MASK:
        raise TypeError(
            f"pipeline pieces call each decoder layer without a mask, which {attn!r} attention does not "
            f"make causal; build the model with attn_implementation in {CAUSAL_WITHOUT_MASK}"
        )
    hf: Any = model  # a transformers model: its submodules are found by name (_gpt2, _llama_like)
    if _gpt2(model):
        t = hf.transformer
        return [GPT2Embedding(t), *(GPT2Layer(b) for b in t.h), NormHead(t.ln_f, hf.lm_head)]
    if _llama_like(model):
        m = hf.model
        return [
            TokenEmbedding(m.embed_tokens),
            *(RotaryLayer(layer, m.rotary_emb) for layer in m.layers),
            NormHead(m.norm, hf.lm_head),
        ]
    raise TypeError(
        f"cannot split {type(model).__name__} into pipeline pieces: the known transformers layouts are "
        "GPT-2 (transformer.wte/wpe/h/ln_f) and Llama-like (model.embed_tokens/layers/norm/rotary_emb)"
    )


def tied_embeddings(model: nn.Module) -> bool:
    hf: Any = model  # a transformers PreTrainedModel
    return hf.get_input_embeddings().weight is hf.get_output_embeddings().weight
