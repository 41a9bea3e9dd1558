"""The KV cache: preallocated per layer, written by position, compacted to the accepted path.

This is the only module that knows transformers' cache internals. Rejected tree nodes cost nothing to
undo: `keep` moves the accepted nodes' keys/values next to the prefix and shortens the length, and
the next forward simply overwrites what lies beyond.
"""
from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .features import features

_CACHE_KEYWORD: dict[type, str] = {}


def cache_kwargs(target, cache) -> dict:
    """The keyword argument that hands ``cache`` to ``target``: ``{"cache": cache}`` where its forward takes
    ``cache`` (transformers 5.24 on, where ``past_key_values`` is deprecated), else ``{"past_key_values": cache}``
    (transformers 5.0 to 5.23). ``target``: a model or a decoder layer (its class's forward is read, not the
    instance's, which may be a compiled step's wrapper), or a class (a module class, or a model output class,
    whose constructor is read). Read once per class."""
    cls = target if isinstance(target, type) else type(target)
    key = _CACHE_KEYWORD.get(cls)
    if key is None:
        try:
            params = inspect.signature(cls.forward if issubclass(cls, torch.nn.Module) else cls).parameters
        except (TypeError, ValueError):  # no signature to read: the old name, which every 5.x release takes
            params = {}
        key = _CACHE_KEYWORD[cls] = "cache" if "cache" in params else "past_key_values"
    return {key: cache}


class SlotLayer(CacheLayerMixin):
    is_sliding = False
    is_croppable = True

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.packing: tuple[torch.Tensor, torch.Tensor, int] | None = None  # see set_packing

    def lazy_initialization(self, key_states, value_states):
        b, h, _, d = key_states.shape
        dv = value_states.shape[-1]
        self.dtype, self.device = key_states.dtype, key_states.device
        self.k_buf = torch.zeros(b, h, self.capacity, d, dtype=self.dtype, device=self.device)
        self.v_buf = torch.zeros(b, h, self.capacity, dv, dtype=self.dtype, device=self.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2] if self.packing is None else self.packing[2]
        end = self.length + n
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} > capacity {self.capacity}")
        if self.packing is None:
            self.k_buf[:, :, self.length:end] = key_states
            self.v_buf[:, :, self.length:end] = value_states
        else:  # packed tokens [1, H, T, d] to their rows' slots; the padding slots are zeroed
            rows, slots, _ = self.packing
            for buf, new in ((self.k_buf, key_states), (self.v_buf, value_states)):
                buf[:, :, self.length:end] = 0
                buf[rows, :, self.length + slots] = new[0].transpose(0, 1)
        self.length = end
        return self.k_buf[:, :, :end], self.v_buf[:, :, :end]

    # the filled slots, as transformers' layers keep them: views made when read, so that a compiled step does not
    # return them as outputs aliasing its inputs (each regenerated after every step)
    @property
    def keys(self):
        return self.k_buf[:, :, :self.length] if self.is_initialized else None

    @keys.setter
    def keys(self, value) -> None:  # (the base class starts it at None; the buffers are the state)
        if value is not None:
            raise AttributeError("a SlotLayer's keys are its buffer's filled slots")

    @property
    def values(self):
        return self.v_buf[:, :, :self.length] if self.is_initialized else None

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("a SlotLayer's values are its buffer's filled slots")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.length = 0

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (a negative ``length``: drop that many, as transformers' caches do)."""
        self.length = min(self.length, length if length >= 0 else max(0, self.length + length))

    @torch.inference_mode()
    def keep(self, start: int, idx: torch.Tensor) -> None:
        """Keep positions [0, start) and then start+idx (sorted, ascending), dropping the rest."""
        n = idx.numel()
        if n and not self._is_identity(idx):
            src = start + idx
            self.k_buf[:, :, start:start + n] = self.k_buf[:, :, src]
            self.v_buf[:, :, start:start + n] = self.v_buf[:, :, src]
        self.length = start + n

    @staticmethod
    def _is_identity(idx: torch.Tensor) -> bool:
        return bool(idx[-1].item() == idx.numel() - 1)


class SpecCache(Cache):
    """A cache of `capacity` positions per layer, batch size fixed by the first write."""

    def __init__(self, num_layers: int, capacity: int):
        self.capacity = capacity
        super().__init__(layers=[SlotLayer(capacity) for _ in range(num_layers)])

    def __len__(self) -> int:
        return self.layers[0].length

    @property
    def length(self) -> int:
        return self.layers[0].length

    def crop(self, length: int) -> None:
        for layer in self.layers:
            layer.crop(length)

    def keep(self, start: int, idx: torch.Tensor) -> None:
        """Compact: positions [0, start) stay; of the positions after it keep those at `idx` (ascending)."""
        for layer in self.layers:
            layer.keep(start, idx)


def text_config(model):
    """The decoder's config (a multimodal model's text part; the model's own config otherwise)."""
    return model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config


def new_cache(model, capacity: int) -> SpecCache:
    return SpecCache(text_config(model).num_hidden_layers, capacity)


# ---- rows: the engine's batch of sequences in one cache ----------------------------------------


def allocate_rows(cache, model, rows: int) -> None:
    """Allocate every layer's buffers for `rows` rows now (SlotLayer would allocate at its first write)."""
    cfg = text_config(model)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    empty = torch.empty(rows, kv_heads, 0, head_dim, dtype=model.dtype, device=model.device)
    for layer in cache.layers:
        layer.lazy_initialization(empty, empty)
        layer.full_k, layer.full_v = layer.k_buf, layer.v_buf
        layer.length = 0


def use_rows(cache, start: int, stop: int) -> None:
    """Make the layers read and write rows [start, stop) of their full buffers."""
    for layer in cache.layers:
        layer.k_buf, layer.v_buf = layer.full_k[start:stop], layer.full_v[start:stop]


def set_length(cache, n: int) -> None:
    """Set every layer's write pointer: the next forward writes at slot ``n`` of every row."""
    for layer in cache.layers:
        layer.length = n


def set_packing(cache, rows: torch.Tensor | None = None, slots: torch.Tensor | None = None, n: int = 0) -> None:
    """The next forward is packed: its T tokens (one sequence) belong to cache rows ``rows`` [T] at slots
    write pointer + ``slots`` [T], and every row's write pointer advances by ``n``. ``rows=None``: back to
    the usual one-sequence-per-row writes."""
    packing = None if rows is None else (rows, slots, n)
    for layer in cache.layers:
        layer.packing = packing


def compact(cache, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Per row b: slots dst[b] <- slots src[b] (padding entries copy a slot onto itself). Advanced
    indexing, not gather/scatter with an expanded index, which is far slower on a CPU and grows with the
    slots (docs/cpu-kernels.md, "Measurements behind the code"). Nothing is copied where every slot stays (rows
    whose new tokens were written where they belong)."""
    if torch.equal(src, dst):
        return
    rows = torch.arange(src.shape[0], device=src.device)[:, None]
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        for name in ("k_buf", "v_buf"):
            buf = getattr(layer, name)
            buf[rows, :, dst] = buf[rows, :, src]  # [B, N, heads, dim] read first, then written


def copy_rows(src, dst, rows: int) -> None:
    """Copy the first ``rows`` rows of every layer of ``src`` into ``dst`` (rows allocated there, at least as
    many slots), with the write pointer; the layers of ``dst`` then use those rows."""
    for a, b in zip(src.layers, dst.layers):
        cap = a.full_k.shape[2]
        b.full_k[:rows, :, :cap] = a.full_k[:rows]
        b.full_v[:rows, :, :cap] = a.full_v[:rows]
        b.length = a.length
    use_rows(dst, 0, rows)


def read_row(cache, row: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row ``row``'s keys and values at slots [0, n), per layer: views [kv_heads, n, head_dim]."""
    return [(layer.full_k[row, :, :n], layer.full_v[row, :, :n]) for layer in cache.layers]


def write_row(cache, row: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write per-layer (keys, values) [kv_heads, n, head_dim] into row ``row`` at slots [0, n)."""
    for layer, (k, v) in zip(cache.layers, kv):
        n = k.shape[1]
        layer.full_k[row, :, :n] = k
        layer.full_v[row, :, :n] = v


def fill_holes(rows: int, gone: list[int]) -> list[int]:
    """The rows that stay when rows ``gone`` of ``rows`` leave, in their new order: each stays where it is,
    except that the last ones take the places of the rows that left (the fewest rows to copy)."""
    out = set(gone)
    keep = [b for b in range(rows) if b not in out]
    movers = iter(b for b in keep if b >= len(keep))
    return [b if b not in out else next(movers) for b in range(len(keep))]


def select_rows(cache, keep: list[int], used: list[int] | None = None) -> None:
    """Drop the cache rows of finished sequences: old row keep[i] becomes row i of the same buffers (allocated
    once, never grown; every keep[i] >= i, as :func:`fill_holes` and ascending lists give, so no row is
    overwritten before it moves) and the layers see only those rows from now on. ``used``: how many leading
    slots of each kept row hold anything (only those are copied; default all)."""
    for i, b in enumerate(keep):
        if b < i:
            raise ValueError(f"select_rows: row {b} cannot move down to {i}")
        if b == i:
            continue
        n = None if used is None else used[i]
        for layer in cache.layers:
            layer.full_k[i, :, :n] = layer.full_k[b, :, :n]
            layer.full_v[i, :, :n] = layer.full_v[b, :, :n]
    use_rows(cache, 0, len(keep))


@torch.inference_mode()
def prefill_rows(model, cache, first: int, prompts: list[list[int]], need_hidden: bool = False,
                 starts: list[int] | None = None) -> list:
    """Write prompts[b] into cache row first + b, slots [starts[b], starts[b] + len(prompts[b])) (starts:
    slots already filled, e.g. from a prefix cache; default 0). Returns each row's last-layer hidden states
    [len, dim] when ``need_hidden`` (None for an empty prompt or otherwise).
    Each row is prefilled by its own forward over exactly its prompt: a prefill is compute-bound, and
    one right-padded [B, longest] forward spent a third of its time on padding for HumanEval prompts.
    The write pointer is restored; the caller selects the rows to use next."""
    dev = model.device
    saved = cache.length
    hidden = []
    for b, ids in enumerate(prompts):
        h = None
        if ids:
            start = starts[b] if starts else 0
            use_rows(cache, first + b, first + b + 1)
            set_length(cache, start)
            out = model(input_ids=torch.tensor([ids], device=dev),
                        position_ids=torch.arange(start, start + len(ids), device=dev)[None],
                        **cache_kwargs(model, cache), use_cache=True, output_hidden_states=need_hidden,
                        logits_to_keep=1)
            h = features(model, out.hidden_states)[0] if need_hidden else None
        hidden.append(h)
    set_length(cache, saved)
    return hidden
