"""The fused small operations of the native CPU kernel (csrc/hs_ops.h): RMSNorm and few-query attention.

What they promise beyond speed: the stock RMSNorm's arithmetic (bit for bit in bf16), attention equal
to the reference math, and attention rows that do not depend on the rows beside them nor on hidden
keys between the ones they see, which makes a tree verify step compute exactly what sequential
decoding computes, in bf16 too (the end-to-end check on real weights is in test_real_model.py).
"""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from hydraspec.cpu import kernels
from hydraspec.cpu.attention import cpu_attention

pytestmark = pytest.mark.skipif(kernels.fused_lib() is None, reason="needs the native CPU kernel (AVX2 + a C compiler)")


def module(groups: int):
    return types.SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)


@torch.inference_mode()
def attend(q, k, v, mask, scaling=None):
    """cpu_attention as a decoding step calls it (no gradients: else it hands over to sdpa)."""
    out, _ = cpu_attention(module(q.shape[1] // k.shape[1]), q, k, v, mask, scaling=scaling)
    return out


def reference_attention(q, k, v, allowed, scale):
    """softmax(q k^T * scale) v in float64 with a [B, n, L] bool mask; returns [B, n, H, dv]."""
    b, h, n, d = q.shape
    g = h // k.shape[1]
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    s = q.double() @ kk.transpose(-1, -2) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed[:, None], float("-inf"))
    return (torch.softmax(s, -1) @ vv).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,hkv,d,n,L", [(12, 2, 128, 5, 37), (14, 2, 64, 1, 203), (9, 3, 64, 7, 66), (4, 4, 24, 3, 9)])
def test_native_attention_matches_the_reference(dtype, h, hkv, d, n, L):
    g = torch.Generator().manual_seed(h * n + L)
    # the engine's layouts: queries transposed out of [B, n, H, d], keys/values a view of a larger cache
    q = torch.randn(2, n, h, d, generator=g).to(dtype).transpose(1, 2)
    kb = torch.randn(2, hkv, L + 11, d, generator=g).to(dtype)
    vb = torch.randn(2, hkv, L + 11, d, generator=g).to(dtype)
    k, v = kb[:, :, :L], vb[:, :, :L]
    allowed = torch.rand(2, n, L, generator=g) > 0.3
    allowed[:, :, 0] = True
    add = torch.zeros(2, 1, n, L, dtype=dtype).masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for mask, seen in ((None, None), (allowed[:, None], allowed), (add, allowed)):
        if mask is None and n > 1:
            continue  # a maskless multi-query call is causal: sdpa's (tests/test_attention.py)
        out = attend(q, k, v, mask, scaling=d ** -0.5)
        assert out.dtype == dtype and out.shape == (2, n, h, d)
        ref = reference_attention(q, k, v, seen, d ** -0.5)
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_row_depends_only_on_its_row_and_the_keys_it_sees(dtype):
    """A verify step's query row (a tree node) against prefix + tree keys, some hidden, equals bit for bit
    the same row computed alone against just the keys it sees: what sequential decoding computes."""
    g = torch.Generator().manual_seed(0)
    h, hkv, d, P, n = 12, 2, 64, 45, 7
    q = torch.randn(1, n, h, d, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(1, hkv, P + n, d, generator=g).to(dtype)
    v = torch.randn(1, hkv, P + n, d, generator=g).to(dtype)
    parents = [-1, 0, 0, 1, 2, 3, 3]  # a tree of 7 nodes: node i sees its ancestors and itself
    allowed = torch.zeros(1, 1, n, P + n, dtype=torch.bool)
    allowed[..., :P] = True
    for i in range(n):
        j = i
        while j >= 0:
            allowed[0, 0, i, P + j] = True
            j = parents[j]
    together = attend(q, k, v, allowed)
    for i in range(n):
        seen = allowed[0, 0, i].nonzero().flatten()
        alone = attend(q[:, :, i:i + 1], k[:, :, seen], v[:, :, seen], None)
        assert torch.equal(together[:, i], alone[:, 0]), f"node {i}"


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen2RMSNorm])
def test_fused_rmsnorm_is_the_stock_arithmetic(cls):
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        norm = cls(200, eps=1e-5).to(dtype)
        norm.weight.data = torch.randn(200, generator=g).to(dtype)
        fused = kernels.FusedRMSNorm(norm)
        x = (torch.randn(3, 5, 200, generator=g) * 3).to(dtype)
        with torch.inference_mode():
            ref, out = norm(x), fused(x)
        assert out.dtype == dtype
        if dtype == torch.bfloat16:  # sums in another order, but the rounding to bf16 hides it
            assert torch.equal(out, ref)
        else:
            torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    # with gradients it is the torch formula, and gradients flow
    norm = cls(16)
    fused = kernels.FusedRMSNorm(norm)
    x = torch.randn(2, 16, requires_grad=True)
    fused(x).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    norm(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_fuse_norms_swaps_llama_kind_norms_only():
    model = nn.Sequential(LlamaRMSNorm(8), GemmaRMSNorm(8), nn.LayerNorm(8), Qwen2RMSNorm(8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert kernels.fuse_norms(model) == 2
    assert [type(m).__name__ for m in model] == ["FusedRMSNorm", "GemmaRMSNorm", "LayerNorm", "FusedRMSNorm"]
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
