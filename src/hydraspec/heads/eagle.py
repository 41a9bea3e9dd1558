"""EAGLE draft head (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty"): one decoder layer that runs autoregressively on the target's own features.

At position i it reads the pair (f_i, e(x_{i+1})): the target's last hidden state f_i (the state the
lm_head reads, which chose token x_{i+1}) and the embedding of that token, joined by a linear map
2 * dim -> dim. The layer attends over the pairs before it (its own KV cache) and outputs a guess of the
next feature f_{i+1}; the base lm_head (frozen, or its rows for a draft vocabulary) turns the guess into
the distribution of x_{i+2}. Drafting deeper feeds the guessed feature back with the drafted token, so
one layer drafts a whole tree. Knowing the next token lets the layer's attention find where that token
occurred before, which heads that read only h_t (Medusa, Hydra) cannot do.

The layer is a fresh layer of the base model's own decoder class (stock transformers, run as it is),
with an MLP width of its own (``intermediate_size``: a narrower MLP drafts faster on a CPU). Drafting is
exact whatever the head guesses: the target verifies every token.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import DynamicCache

from ..backend import causal_mask, rotary_at
from ..cache import SpecCache, cache_kwargs
from ..errors import HydraspecError
from .modules import Heads


def decoder_of(model):
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        raise HydraspecError(f"{type(model).__name__}: no decoder layers / rotary embedding found for an EAGLE layer")
    return base


def additive(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """[n, L] bool (True = attend) -> [1, 1, n, L] additive mask of ``dtype``."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


class EagleHeads(Heads):
    """``num_heads`` is the deepest draft the head is meant for (trees are checked against it); the same
    layer drafts every depth. ``num_layers`` decoder layers (EAGLE uses one)."""

    kind = "eagle"
    regresses_features = True  # EAGLE-1's loss scores the guessed next feature too

    def __init__(self, hidden, vocab, num_heads=4, num_layers=1, lm_head=None, own_projection=False,
                 vocab_subset=None, layers=None, rotary=None):
        super().__init__(hidden, vocab, num_heads, num_layers, lm_head, own_projection, vocab_subset)
        self.fc = nn.Linear(2 * hidden, hidden)
        self.layers = nn.ModuleList(layers or [])
        self._rotary = [rotary]  # the base's rotary embedding: shared, not a parameter of the head

    @classmethod
    def for_model(cls, model, num_heads=4, num_layers=1, own_projection=False, vocab_subset=None,
                  intermediate_size=None, **_):
        base = decoder_of(model)
        cfg = copy.deepcopy(model.config.get_text_config(decoder=True))
        if intermediate_size:
            cfg.intermediate_size = int(intermediate_size)
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = ["full_attention"] * max(num_layers, len(cfg.layer_types))
        cfg.num_hidden_layers = num_layers
        layer_cls = type(base.layers[-1])
        layers = [layer_cls(cfg, layer_idx=i) for i in range(num_layers)]
        heads = cls(cfg.hidden_size, cfg.vocab_size, num_heads=num_heads, num_layers=num_layers,
                    lm_head=model.get_output_embeddings(), own_projection=own_projection,
                    vocab_subset=vocab_subset, layers=layers, rotary=base.rotary_emb)
        heads.intermediate_size = cfg.intermediate_size
        return heads

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the layer computes in (its norms' weights: matrices may sit on quantised kernels); found once
        and again after every conversion (``to``, ``float`` ...: :meth:`_apply`), as every draft step asks it."""
        found = self.__dict__.get("_dtype")
        if found is None:
            found = self.__dict__["_dtype"] = next(p.dtype for p in self.layers.parameters() if p.is_floating_point())
        return found

    def _apply(self, fn, *args, **kwargs):
        self.__dict__.pop("_dtype", None)
        return super()._apply(fn, *args, **kwargs)

    def extra_config(self) -> dict:
        return {"intermediate_size": self.intermediate_size}

    def step(self, feats: torch.Tensor, token_emb: torch.Tensor, positions: torch.Tensor, cache=None,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """feats, token_emb: [n, dim] pairs (f_i, e(x_{i+1})) at ``positions`` [n], after what ``cache`` holds
        (a transformers cache of this head's layers, or None: the n pairs alone). mask: [1, 1, n, cached + n]
        additive, default causal. Returns [n, dim]: the guessed next features."""
        dtype = self.dtype
        x = self.fc(torch.cat([feats.to(dtype), token_emb.to(dtype)], dim=-1))[None]
        past = cache.get_seq_length() if cache is not None else 0
        if mask is None:
            mask = causal_mask(x.shape[1], past, x.dtype, x.device)
        pos = positions[None]
        cos_sin = rotary_at(self._rotary[0], x, pos)
        for layer in self.layers:
            out = layer(hidden_states=x, attention_mask=mask, position_ids=pos, **cache_kwargs(layer, cache),
                        use_cache=cache is not None, position_embeddings=cos_sin)
            x = out[0] if isinstance(out, tuple) else out
        return x[0]

    def guesses(self, feats: torch.Tensor, tok: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The guesses [n, dim] at every draft depth 1 .. ``steps`` for the pairs (feats[j], tok[j]) at positions
        j = 0 .. n - 1, as drafting computes them along the true tokens (for training and for tree
        calibration): depth 1 reads the true pairs; depth k reads, at position j, depth k - 1's guess at
        j - 1 with tok[j], and attends to the true pairs up to j - k + 1, to the same chain's rows of the
        depths between, and to itself (what a draft committed up to j - k + 1 sees). Rows j < k - 1 of
        depth k have no such chain: they see only themselves."""
        n = feats.shape[0]
        pos = torch.arange(n, device=feats.device)
        cache = new_cache()
        out = [self.step(feats, tok, pos, cache)]
        for k in range(2, steps + 1):
            prev = torch.cat([out[-1][:1], out[-1][:-1]])  # row j reads the previous depth's guess at j - 1
            allowed = torch.zeros(n, k * n, dtype=torch.bool, device=feats.device)
            allowed[:, :n] = pos[None, :] <= pos[:, None] - k + 1  # the true pairs
            chain = pos >= k - 1
            for m in range(2, k):  # this chain's rows of the depths between
                allowed[pos[chain], (m - 1) * n + pos[chain] - k + m] = True
            allowed[pos, (k - 1) * n + pos] = True  # itself
            out.append(self.step(prev, tok, pos, cache, additive(allowed, self.dtype)))
        return out

    def logits(self, k: int, hidden: torch.Tensor, path_emb: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of guessed features [..., dim] (the same projection at every depth ``k``)."""
        return self.project(0, hidden)


def new_cache(capacity: int = 0, layers: int = 1):
    """The head layers' KV cache: ``capacity`` slots per layer allocated once and written in place (a drafter
    knows how long its sequence can get), else a growing DynamicCache (training's passes)."""
    return SpecCache(layers, capacity) if capacity > 0 else DynamicCache()
