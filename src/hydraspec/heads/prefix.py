"""Hydra++'s prefix attention: one extra decoder layer, of the base model's own class, over the base
model's last hidden states. Its output replaces the hidden state that the draft heads read, so the heads
see a summary of the whole prefix and not only of the last token.

The layer is a copy of the base's last decoder layer (the stock transformers class, run as it is) with
its two output projections zeroed, so that a fresh prefix layer is the identity and fresh heads still
equal the base lm_head. At decoding time it runs once per step over the hidden states of the tokens
the target has just committed (the pending token and the accepted drafts), with a KV cache of its own
that only ever grows: nothing rejected is ever fed to it.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import DynamicCache

from ..backend import unpack
from ..cache import cache_kwargs


def _decoder(model):
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        raise ValueError(f"{type(model).__name__}: no decoder layers / rotary embedding found for a prefix layer")
    return base


def _zero_output(layer: nn.Module) -> None:
    """Zero the projections that write back into the residual stream (attention out, MLP down)."""
    for name, mod in layer.named_modules():
        if isinstance(mod, nn.Linear) and name.split(".")[-1] in ("o_proj", "down_proj", "out_proj", "dense_4h_to_h",
                                                                   "c_proj", "w2", "fc2"):
            nn.init.zeros_(mod.weight)
            if mod.bias is not None:
                nn.init.zeros_(mod.bias)


class PrefixLayer(nn.Module):
    def __init__(self, model):
        super().__init__()
        base = _decoder(model)
        last = base.layers[-1]
        # prepacked oneDNN weights cannot be deep-copied (and would go stale): copy without them
        memo = {id(m.packed): None for m in last.modules() if getattr(m, "packed", None) is not None}
        try:
            layer = copy.deepcopy(last, memo)
        except (TypeError, ValueError):  # weights held for a native kernel (GGUF codes): a fresh layer of the
            # same class; loaded heads overwrite its weights, and its zeroed outputs make it the identity
            layer = type(last)(model.config.get_text_config(decoder=True), layer_idx=len(base.layers) - 1)
        self.layer = unpack(layer)
        self.layer.requires_grad_(True)
        for mod in self.layer.modules():  # its own one-layer cache
            if hasattr(mod, "layer_idx"):
                mod.layer_idx = 0
        _zero_output(self.layer)
        self._rotary = [base.rotary_emb]  # shared with the base, not a parameter of the heads

    def forward(self, hidden: torch.Tensor, start: int = 0, cache=None) -> torch.Tensor:
        """hidden: [n, dim] base hidden states of positions start .. start + n - 1 (all earlier ones
        are in `cache`, or start = 0). Returns [n, dim]: each position attends to itself and all before."""
        n = hidden.shape[0]
        dev = hidden.device
        dtype = next(self.layer.parameters()).dtype
        x = hidden.to(dtype)[None]
        pos = torch.arange(start, start + n, device=dev)[None]
        cos_sin = self._rotary[0](x, pos)
        total = start + n
        allowed = torch.arange(total, device=dev)[None, :] <= pos[0][:, None]  # [n, total] causal
        mask = torch.zeros(n, total, dtype=dtype, device=dev).masked_fill_(~allowed, torch.finfo(dtype).min)
        out = self.layer(hidden_states=x, attention_mask=mask[None, None], position_ids=pos,
                         **cache_kwargs(self.layer, cache), use_cache=cache is not None, position_embeddings=cos_sin)
        if isinstance(out, tuple):
            out = out[0]
        return out[0]


def new_prefix_cache():
    return DynamicCache()
