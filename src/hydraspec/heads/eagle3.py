"""EAGLE-3 draft head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
via Training-Time Test"): an EAGLE layer that reads a low, a middle and a high layer of the target instead
of its last state, and learns from the token distribution alone.

At a committed position i the target's states of the chosen layers (hydraspec.features) are joined and
mapped by ``fc`` (k * dim -> dim) to g_i; the layer reads g_i with the embedding of x_{i+1}: the embedding
through ``input_layernorm``, g_i through ``hidden_norm``, the two concatenated (2 * dim) into q, k and v,
with g_i as the residual. Its output o_i, after ``norm``, goes to the frozen lm_head rows (the whole
vocabulary or a draft vocabulary) for x_{i+2}. Drafting deeper feeds o_i back in place of g (the layer's
own output, as trained by training-time test: :meth:`EagleHeads.guesses`). There is no feature target:
the loss is the target's next-token distribution at every depth.

The layer is a stock transformers ``LlamaDecoderLayer`` sized from the target (its heads, head size, RoPE),
with q, k and v widened to 2 * dim, the layout of the EAGLE-3 checkpoints that vLLM and SGLang load
(heads.speculators_format writes it). Drafting is exact whatever the head guesses: the target verifies
every token.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from ..backend import causal_mask, rotary_at
from ..cache import cache_kwargs
from .eagle import EagleHeads
from .modules import Heads

__all__ = ["Eagle3Heads", "default_feature_layers", "layer_config"]


def default_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers (hidden-state indices 2, L // 2, L - 3), kept distinct and in
    range for small models."""
    return sorted({min(2, num_layers), num_layers // 2, max(num_layers - 3, 0)})


def layer_config(model, intermediate_size: int | None = None) -> LlamaConfig:
    """A one-layer Llama config of the target's sizes (hidden, heads, key/value heads, head size, RoPE)."""
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    out = LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=int(intermediate_size or cfg.intermediate_size),
                      num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                      head_dim=head_dim, rms_norm_eps=cfg.rms_norm_eps, vocab_size=cfg.vocab_size,
                      max_position_embeddings=cfg.max_position_embeddings, hidden_act=cfg.hidden_act,
                      rope_parameters=dict(cfg.rope_parameters), num_hidden_layers=1, attention_bias=False,
                      mlp_bias=False)
    out._attn_implementation = cfg._attn_implementation or "sdpa"
    return out


def widen_qkv(layer: LlamaDecoderLayer, cfg: LlamaConfig) -> None:
    """q, k and v of ``layer`` read 2 * dim: the normed embedding and the normed fused state, side by side."""
    attn, dim = layer.self_attn, cfg.hidden_size
    attn.q_proj = nn.Linear(2 * dim, cfg.num_attention_heads * cfg.head_dim, bias=False)
    attn.k_proj = nn.Linear(2 * dim, cfg.num_key_value_heads * cfg.head_dim, bias=False)
    attn.v_proj = nn.Linear(2 * dim, cfg.num_key_value_heads * cfg.head_dim, bias=False)


class Eagle3Heads(EagleHeads):
    """``feature_layers``: the hidden-state indices the head reads; ``num_heads``: the deepest draft it is
    meant for. One layer (``num_layers`` must be 1)."""

    kind = "eagle3"
    method = "eagle"
    regresses_features = False

    def __init__(self, hidden, vocab, feature_layers, num_heads=4, lm_head=None, own_projection=False,
                 vocab_subset=None, config: LlamaConfig | None = None):
        # the common heads' part only: EagleHeads' own fc and layer are not this head's
        Heads.__init__(self, hidden, vocab, num_heads, 1, lm_head, own_projection, vocab_subset)
        self.feature_layers = [int(i) for i in feature_layers]
        if len(self.feature_layers) < 2:
            raise ValueError("an EAGLE-3 head reads at least two layers")
        self.fc = nn.Linear(len(self.feature_layers) * hidden, hidden, bias=False)
        layer = LlamaDecoderLayer(config, layer_idx=0)
        widen_qkv(layer, config)
        self.layers = nn.ModuleList([layer])
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)
        self.config = config
        self.intermediate_size = config.intermediate_size

    @classmethod
    def for_model(cls, model, num_heads=4, num_layers=1, own_projection=False, vocab_subset=None,
                  intermediate_size=None, feature_layers=None, **_):
        if num_layers != 1:
            raise ValueError("an EAGLE-3 head has one layer")
        cfg = model.config.get_text_config(decoder=True)
        layers = feature_layers or default_feature_layers(cfg.num_hidden_layers)
        return cls(cfg.hidden_size, cfg.vocab_size, layers, num_heads=num_heads,
                   lm_head=model.get_output_embeddings(), own_projection=own_projection, vocab_subset=vocab_subset,
                   config=layer_config(model, intermediate_size))

    def extra_config(self) -> dict:
        return {"intermediate_size": self.intermediate_size, "feature_layers": self.feature_layers}

    def step(self, feats: torch.Tensor, token_emb: torch.Tensor, positions: torch.Tensor, cache=None,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """feats: [n, k * dim] the target's joined states (fused by ``fc``) or [n, dim] the layer's own
        outputs (deeper drafts); token_emb [n, dim]; the rest as :meth:`EagleHeads.step`. Returns [n, dim]."""
        dtype = self.dtype
        g = feats.to(dtype)
        if g.shape[-1] != self.hidden:
            g = self.fc(g)
        g, e = g[None], token_emb.to(dtype)[None]
        past = cache.get_seq_length() if cache is not None else 0
        if mask is None:
            mask = causal_mask(g.shape[1], past, g.dtype, g.device)
        layer = self.layers[0]
        x = torch.cat([layer.input_layernorm(e), self.hidden_norm(g)], dim=-1)
        out = layer.self_attn(hidden_states=x, position_embeddings=rotary_at(self.rotary, g, positions[None]),
                              attention_mask=mask, **cache_kwargs(layer.self_attn, cache))
        h = g + (out[0] if isinstance(out, tuple) else out)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h[0]

    def logits(self, k: int, hidden: torch.Tensor, path_emb: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the layer's outputs [..., dim], after its own final norm (every depth alike)."""
        return self.project(0, self.norm(hidden.to(self.dtype)))
