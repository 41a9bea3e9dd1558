"""One forward of a stock Hugging Face causal LM over a token tree.

Each node attends to the whole cached prefix and to its own ancestors (4D additive mask), at position
prefix length + depth. A chain needs no custom mask: the model's own causal mask is the tree mask.
"""
from __future__ import annotations

import torch

from . import backend
from .cache import cache_kwargs, set_length, set_packing, text_config
from .errors import HydraspecError
from .features import features

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


def can_pack(model) -> bool:
    """Whether :func:`verify_rows` can run this model's rows packed (it runs the backend's attention)."""
    return backend.packed_keyword(model) is not None


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
        # keys: the prefix at their slots, the tree part no older than the prefix's end (never out of a window)
        mask = with_window(model, mask, lambda: (positions[None],
                                                  torch.arange(mask.shape[-1]).clamp(max=prefix_len)[None]))
    out = model(
        input_ids=ids[None],
        position_ids=positions[None],
        attention_mask=mask,
        **cache_kwargs(model, cache),
        use_cache=True,
        output_hidden_states=want_hidden,
        logits_to_keep=1 if last_only else 0,
    )
    logits = out.logits[0].float()
    hidden = features(model, out.hidden_states)[0] if want_hidden else None
    return logits, hidden


def window_of(model) -> tuple[int, bool] | None:
    """(sliding window, whether layers differ by type) where some layers attend within a window (Mistral, Phi-3:
    every layer; Qwen2/3, Gemma 2/3: the layers of type "sliding_attention"), else None."""
    cfg = text_config(model)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if not window or (types is not None and "sliding_attention" not in types):
        return None
    return window, types is not None


def with_window(model, mask: torch.Tensor, positions):
    """The attention mask(s) the model's forward takes for the 4D additive ``mask`` [B, 1, Q, K]. Where layers
    slide (:func:`window_of`), a key more than the window behind its query is hidden from those layers, as
    transformers' own masks do: one mask where every layer slides, else one per layer type; elsewhere ``mask``
    itself. ``positions()`` -> (query positions [B, Q], key positions [B, K]), called only where a window is."""
    slides = window_of(model)
    if slides is None:
        return mask
    window, per_type = slides
    q_pos, k_pos = positions()
    far = k_pos.to(mask.device)[:, None, :] <= q_pos.to(mask.device)[:, :, None] - window  # [B, Q, K]
    slid = mask.masked_fill(far[:, None], torch.finfo(mask.dtype).min)
    return {"full_attention": mask, "sliding_attention": slid} if per_type else slid


def ragged_positions(lengths: list[int], W: int, q_pos: torch.Tensor) -> torch.Tensor:
    """[B, W + N] key positions of a ragged forward: slot j < W holds position j (a row's cache is left-aligned;
    its gap is masked anyway), slot W + i the new node i (``q_pos`` [B, N])."""
    return torch.cat([torch.arange(W).expand(len(lengths), W), q_pos], dim=1)


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


@torch.inference_mode()
def verify_rows(model, cache, nodes: list[list[int]], shapes: list, lengths: list[int], want_hidden: bool = False,
                packed: bool = True, device=None, dtype=None, skip: list[int] | None = None):
    """One forward over every cached row's verify tree: row b's ``nodes[b]`` (pending token, then drafts;
    ``shapes[b]`` its tree shape) at positions lengths[b] + depth, written at slots [W, W + N) of the cache
    (W = max(lengths), N = the largest tree), each node seeing its row's cache and its own ancestors.

    Packed (where the backend's attention runs, see :func:`hydraspec.backend.packed_keyword`): the rows'
    nodes go through the model as one sequence of T = sum of tree sizes tokens, so a row's verify tree costs
    the linear layers only its own nodes. Otherwise the rows are padded to N nodes with dummy nodes that
    see only themselves. Either way each row's logits equal its own forward's (the kernels are row-wise).

    ``skip``: per row, its first nodes whose logits no one reads (prompt tokens read beside the trees); packed,
    the model projects only the other nodes onto the vocabulary.

    Returns float32 logits [T', vocab], hidden states [T', dim] (or None) and each row's first index into
    them past its skipped nodes (T' = T less the skipped nodes packed, B * N padded)."""
    dev = device or model.device  # (the model's properties walk its parameters: callers that know pass them)
    dtype = dtype or model.dtype
    B, N, W = len(nodes), max(s.size for s in shapes), max(lengths)
    tree_allowed = torch.eye(N, dtype=torch.bool).repeat(B, 1, 1)  # dummy nodes see only themselves
    for b, shape in enumerate(shapes):
        tree_allowed[b, :shape.size, :shape.size] = shape.ancestors
    set_length(cache, W)
    mask = ragged_mask(lengths, W, tree_allowed, dtype, dev)
    keyword = backend.packed_keyword(model) if packed and B > 1 else None
    if keyword is not None:
        sizes = [s.size for s in shapes]
        padding = torch.arange(N) >= torch.tensor(sizes)[:, None]  # [B, N]: no token sits there
        mask.masked_fill_(padding.to(dev)[:, None, :, None], torch.finfo(mask.dtype).min)  # so it sees nothing
        masks = with_window(model, mask, lambda: _ragged_query_keys(lengths, W, N, shapes))
        rows = torch.repeat_interleave(torch.arange(B), torch.tensor(sizes))
        slots = torch.cat([torch.arange(n) for n in sizes])
        ids = torch.tensor([t for row in nodes for t in row])[None]
        pos = torch.cat([lengths[b] + s.depth for b, s in enumerate(shapes)])[None]
        keep, first = kept_nodes(sizes, skip or [0] * B)
        set_packing(cache, rows.to(dev), slots.to(dev), N)
        try:
            out = model(input_ids=ids.to(dev), position_ids=pos.to(dev), attention_mask=masks,
                        **cache_kwargs(model, cache), use_cache=True, output_hidden_states=want_hidden,
                        logits_to_keep=0 if keep is None else keep.to(dev), **{keyword: (rows * N + slots).to(dev)})
        finally:
            set_packing(cache)
    else:
        ids = torch.zeros(B, N, dtype=torch.long)
        pos = torch.empty(B, N, dtype=torch.long)
        for b, (row, shape) in enumerate(zip(nodes, shapes)):
            ids[b, :shape.size] = torch.tensor(row)
            pos[b, :shape.size] = lengths[b] + shape.depth
            pos[b, shape.size:] = lengths[b]
        masks = with_window(model, mask, lambda: (pos, ragged_positions(lengths, W, pos)))
        out = model(input_ids=ids.to(dev), position_ids=pos.to(dev), attention_mask=masks,
                    **cache_kwargs(model, cache), use_cache=True, output_hidden_states=want_hidden)
        keep, first = None, [b * N + (skip[b] if skip else 0) for b in range(B)]
    logits = out.logits.float().flatten(0, 1)
    hidden = features(model, out.hidden_states).flatten(0, 1) if want_hidden else None
    if hidden is not None and keep is not None:
        hidden = hidden[keep.to(hidden.device)]
    return logits, hidden, first


def kept_nodes(sizes: list[int], skip: list[int]) -> tuple[torch.Tensor | None, list[int]]:
    """A packed forward of rows of ``sizes`` nodes, each row's first ``skip`` nodes without logits: the packed
    indices that keep theirs (None: all do), and each row's first index among the kept."""
    if not any(skip):
        return None, torch.tensor([0] + sizes[:-1]).cumsum(0).tolist()
    keep, first, at = [], [], 0
    for size, s in zip(sizes, skip):
        first.append(len(keep))
        keep.extend(range(at + s, at + size))
        at += size
    return torch.tensor(keep), first


def _ragged_query_keys(lengths: list[int], W: int, N: int, shapes) -> tuple[torch.Tensor, torch.Tensor]:
    """Query positions [B, N] of every row's tree nodes (padding at the row's length) and the keys' [B, W + N]."""
    depth = torch.zeros(len(shapes), N, dtype=torch.long)
    for b, shape in enumerate(shapes):
        depth[b, :shape.size] = shape.depth
    q_pos = torch.tensor(lengths)[:, None] + depth
    return q_pos, ragged_positions(lengths, W, q_pos)
