"""One forward of a stock Hugging Face causal LM over a token tree.

Each node attends to the whole cached prefix and to its own ancestors (4D additive mask), at position
prefix length + depth. A chain needs no custom mask: the model's own causal mask is the tree mask.
"""
from __future__ import annotations

import torch

from .errors import HydraspecError

_NO_4D_MASK = ("flash_attention_2", "flash_attention_3", "flex_attention")


def check_supported(model) -> None:
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if any(impl.startswith(x) for x in _NO_4D_MASK) or "paged" in impl:
        raise HydraspecError(
            f"attention implementation '{impl}' cannot take a 4D tree attention mask; "
            "load the model with attn_implementation='sdpa' or 'eager'"
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise HydraspecError("encoder-decoder models are not supported: hydraspec needs a causal LM")


def tree_mask(prefix_len: int, ancestors: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """[1, 1, n, prefix_len + m] additive mask; `ancestors` is [n, m] bool over the tree part of the cache."""
    n, m = ancestors.shape
    allowed = torch.ones(n, prefix_len + m, dtype=torch.bool, device=device)
    allowed[:, prefix_len:] = ancestors.to(device)
    mask = torch.zeros(n, prefix_len + m, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@torch.inference_mode()
def forward_nodes(model, cache, ids: torch.Tensor, positions: torch.Tensor, ancestors: torch.Tensor | None,
                  prefix_len: int, want_hidden: bool = False, last_only: bool = False):
    """Run `ids` ([n] long) through `model` after what `cache` holds.

    positions: [n] absolute positions.  ancestors: [n, m] bool over the cache positions
    [prefix_len, prefix_len + m) where m = cache length - prefix_len + n, or None for plain causal.
    Returns logits [n, vocab] (or [1, vocab] with last_only) in float32, and hidden [n, dim] or None.
    """
    mask = None
    if ancestors is not None:
        mask = tree_mask(prefix_len, ancestors, model.dtype, model.device)
    out = model(
        input_ids=ids[None],
        position_ids=positions[None],
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=want_hidden,
        logits_to_keep=1 if last_only else 0,
    )
    logits = out.logits[0].float()
    hidden = out.hidden_states[-1][0] if want_hidden else None
    return logits, hidden


def ragged_mask(lengths: list[int], W: int, tree_allowed: torch.Tensor, dtype, device) -> torch.Tensor:
    """[B, 1, N, W + N] additive mask, built on the device: row b's N new nodes (written at slots
    [W, W + N)) see its cache [0, lengths[b]) and, among the new slots, what tree_allowed[b] ([N, N] bool)
    allows; the gap [lengths[b], W) is hidden."""
    B, N, _ = tree_allowed.shape
    prefix = torch.arange(W, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]  # [B, W]
    allowed = torch.cat([prefix[:, None, :].expand(B, N, W), tree_allowed.to(device)], dim=-1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]
