"""An attention function for decoding and tree verification on the CPU, registered with transformers.

PyTorch's CPU `scaled_dot_product_attention` is tuned for long query blocks. For the few queries of a
decoding step or a verify step it costs far more than the arithmetic (growing in steps with the context;
docs/cpu-kernels.md, "Measurements behind the code"). `hydraspec_cpu` computes those cases directly: grouped-query
heads are folded into the query rows (no repeated keys), scores and softmax in float32, then the
weighted values. A prompt or a chunk of one (up to :data:`PREFILL_PAIRS` query-key pairs, causal when no
mask is given) runs there too (1.7-2.8x faster than sdpa for 64-4,000 tokens, docs/cpu-kernels.md). Longer
prompts and anything unusual (softcap, attention sinks, dropout, output_attentions, a maskless multi-query
call that is not causal, a GPU tensor, training with gradients) go to transformers' own sdpa function.

It is registered under the name "hydraspec_cpu" for `attn_implementation` through transformers'
public AttentionInterface / AttentionMaskInterface (the model classes stay the stock ones);
:func:`hydraspec.models.load_model` selects it on the CPU.
"""
from __future__ import annotations

import ctypes

import torch
import transformers

from . import kernels, ops

NAME = "hydraspec_cpu"
MAX_QUERIES = 64  # query rows a call may have here whatever its keys (decoding, verifying)
PREFILL_PAIRS = 1 << 22  # query x key pairs of a longer call (a prompt) handled here (a causal mask: 4 MB)
PACKED = "hs_packed_index"  # the model-call keyword that marks a packed forward (see packed_attention)


def _fallback(module, query, key, value, attention_mask, **kwargs):
    return transformers.integrations.sdpa_attention.sdpa_attention_forward(module, query, key, value, attention_mask,
                                                                          **kwargs)


def cpu_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  is_causal: bool | None = None, **kwargs):
    """query [B, H, n, d], key/value [B, Hkv, L, d(v)], attention_mask None (one query: attend to all; as many
    queries as keys: causal, as sdpa's is_causal) or [B, 1|H, n, >=L] bool (True = attend) or additive float.
    Returns ([B, n, H, dv], None). A packed forward (keyword ``hs_packed_index``) goes through
    :func:`packed_attention`."""
    index = kwargs.pop(PACKED, None)
    if index is not None:
        return packed_attention(module, query, key, value, attention_mask, index, dropout=dropout, scaling=scaling,
                                is_causal=is_causal, **kwargs)
    b, h, n, d = query.shape
    hkv, kv_len = key.shape[1], key.shape[2]
    plain = _plain(query, h, hkv, dropout, kwargs)
    scale = scaling if scaling is not None else d ** -0.5
    prompt = _prompt_mask(module, attention_mask, n, kv_len, is_causal) if plain and not ops.tracing() else None
    if prompt is not None:
        out = _native(query, key, value, prompt, scale)
        if out is not None:
            return out, None
    if not (plain and n <= MAX_QUERIES and (attention_mask is not None or n == 1)):
        return _fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         is_causal=is_causal, **kwargs)
    if ops.tracing() and _kernel_takes(query, key, value, attention_mask):
        return torch.ops.hydraspec.attention(query, key, value, attention_mask, scale), None
    out = _native(query, key, value, attention_mask, scale)
    if out is not None:
        return out, None
    g = h // hkv
    # heads h = j * g + i share kv head j: fold the g query heads of a kv head into the rows
    q = query.reshape(b, hkv, g * n, d).float()
    scores = torch.matmul(q, key.float().transpose(-1, -2))  # [B, Hkv, g*n, L]
    scores.mul_(scale)
    if attention_mask is not None:
        m = attention_mask[..., :kv_len]
        if m.shape[1] == 1:
            m = m.reshape(m.shape[0], 1, 1, n, kv_len)
        else:
            m = m.reshape(m.shape[0], hkv, g, n, kv_len)
        s5 = scores.view(b, hkv, g, n, kv_len)
        if m.dtype == torch.bool:
            s5.masked_fill_(~m, float("-inf"))
        else:
            s5.add_(m.float())
    probs = torch.softmax(scores, dim=-1)
    if attention_mask is not None:
        probs = probs.nan_to_num_(0.0)  # a query row that may see nothing (padding) gets zeros, not NaN
    out = torch.matmul(probs, value.float())  # [B, Hkv, g*n, dv]
    out = out.view(b, h, n, value.shape[-1]).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _plain(query, h: int, hkv: int, dropout: float, kwargs: dict) -> bool:
    """Whether a call is one this module computes: CPU inference, no dropout, softcap, sinks, position bias or
    returned weights, query heads grouped evenly over the key/value heads."""
    return (query.device.type == "cpu" and not torch.is_grad_enabled() and not dropout and h % hkv == 0
            and all(kwargs.get(k) is None for k in ("softcap", "s_aux", "sinks", "position_bias", "cache"))
            and not kwargs.get("output_attentions"))


def _prompt_mask(module, mask, n: int, kv_len: int, is_causal: bool | None) -> torch.Tensor | None:
    """The mask under which a prompt, or a chunk of one, runs on the kernel: the caller's for more than
    MAX_QUERIES queries, a causal one where none is given and sdpa would take the call as causal (as many
    queries as keys); None for calls of one query or over PREFILL_PAIRS pairs, and for the decoding steps'
    few masked queries (the path below)."""
    if n < 2 or n * kv_len > PREFILL_PAIRS:
        return None
    if mask is not None:
        return mask if n > MAX_QUERIES else None
    causal = n == kv_len and is_causal is not False and getattr(module, "is_causal", True)
    return causal_rows(n, n) if causal else None


def causal_rows(n: int, kv_len: int) -> torch.Tensor:
    """[1, 1, n, kv_len] bool: the last n of kv_len positions, each seeing itself and every key before it."""
    return torch.ones(n, kv_len, dtype=torch.bool).tril(kv_len - n)[None, None]


def packed_attention(module, query, key, value, attention_mask, index: torch.Tensor, **kwargs):
    """Attention for a packed forward: the new tokens of B cached sequences run as one sequence of T tokens
    (query [1, H, T, d]; the linear layers then see no padding), while the cache and the mask keep the padded
    layout (key/value [B, Hkv, L, d], attention_mask [B, 1, N, L]). ``index`` [T] gives each token's place
    b * N + j in that layout. The queries are scattered into it, attended as usual, and gathered back:
    ([1, T, H, dv], None)."""
    b, n = key.shape[0], attention_mask.shape[-2]
    h, d = query.shape[1], query.shape[3]
    q = query.new_zeros(b * n, h, d)
    q[index] = query[0].transpose(0, 1)
    q = q.view(b, n, h, d).transpose(1, 2)
    out, _ = cpu_attention(module, q, key, value, attention_mask, **kwargs)  # [B, N, H, dv]
    return out.reshape(b * n, h, out.shape[-1])[index][None], None


_MASK_KIND = {torch.bool: 1, torch.float32: 2, torch.bfloat16: 3}
_I64x3 = ctypes.c_int64 * 3  # the kernel's stride triples


def _kernel_takes(query, key, value, attention_mask) -> bool:
    """Whether the native kernel takes these inputs by shape and dtype (float32 / bf16, head sizes a multiple
    of 8, a mask [B|1, 1, n, >= L] bool or of the queries' dtype); strides are the caller's to fix."""
    dt = query.dtype
    if dt not in (torch.float32, torch.bfloat16) or key.dtype != dt or value.dtype != dt:
        return False
    if query.shape[-1] % 8 or value.shape[-1] % 8:
        return False
    m = attention_mask
    return m is None or (m.dim() == 4 and m.shape[1] == 1 and m.shape[2] == query.shape[2]
                         and m.shape[0] in (1, query.shape[0]) and m.shape[-1] >= key.shape[2]
                         and m.dtype in (torch.bool, dt))


def _native(query, key, value, attention_mask, scale: float):
    """The same attention as one call of the native kernel (``hs_attention``, csrc/hs_ops.h), or None where
    it does not apply (no kernel, other dtypes, a per-head mask, strided last dimensions)."""
    lib = kernels.fused_lib()  # looked up per call: HYDRASPEC_FUSED (or a patched fused_lib) switches it
    if (lib is None or query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1
            or not _kernel_takes(query, key, value, attention_mask)):
        return None  # also per-head masks, additive masks of another dtype: the torch path
    dt = query.dtype
    b, h, n, d = query.shape
    hkv, kv_len, dv = key.shape[1], key.shape[2], value.shape[-1]
    mkind, mptr, ms = 0, None, (0, 0)
    if attention_mask is not None:
        m = attention_mask
        if m.stride(-1) != 1:
            m = m.contiguous()
        mkind, mptr = _MASK_KIND[m.dtype], m.data_ptr()
        ms = (m.stride(0) if m.shape[0] > 1 else 0, m.stride(2))  # only the first kv_len columns are read
    out = torch.empty(b, n, h, dv, dtype=dt)
    err = lib.hs_attention(query.data_ptr(), _I64x3(*query.stride()[:3]), key.data_ptr(), _I64x3(*key.stride()[:3]),
                           value.data_ptr(), _I64x3(*value.stride()[:3]), mptr, _I64x3(ms[0], ms[1], 0), mkind,
                           dt == torch.bfloat16, b, h, hkv, n, kv_len, d, dv, scale, out.data_ptr(),
                           torch.get_num_threads())
    if err:
        raise MemoryError("hydraspec CPU attention kernel: out of memory")
    return out


_registered = False


def register() -> str:
    """Register the function with transformers (once); returns its attn_implementation name."""
    global _registered
    if not _registered:  # (transformers loads these modules on first use)
        transformers.AttentionInterface.register(NAME, cpu_attention)
        transformers.masking_utils.AttentionMaskInterface.register(NAME, transformers.masking_utils.sdpa_mask)
        _registered = True
    return NAME
