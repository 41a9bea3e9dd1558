"""The rotary position embedding of the stock decoder layers as one native call (``hs_rope_bf16`` in
csrc/hs_ops.h) instead of about fourteen torch operations per layer and token step.

transformers' Llama-kind attention (Llama, Qwen2, Mistral, SmolLM ...) calls its modeling module's
``apply_rotary_pos_emb(q, k, cos, sin)`` (the rotate-half form of RoFormer, Su et al. 2021). As
kernel-patching libraries such as Liger Kernel do, :func:`fuse_rope` puts a dispatcher in that module's
name: bf16 CPU tensors without gradients go to the native kernel, everything else to the stock function.
The kernel rounds each product and the sum to bf16 as torch's bf16 operations do, so its result equals the
stock function's bit for bit (tested); nothing a model computes changes, only the time it takes.
"""
from __future__ import annotations

import ctypes
import sys

import torch
import transformers

from . import kernels, ops
from .stock import same_source

__all__ = ["fuse_rope", "rope_is_native"]


def _is_plain_rope(module) -> bool:
    """Whether a modeling module's apply_rotary_pos_emb and rotate_half are Llama's."""
    ml = transformers.models.llama.modeling_llama
    fn, rot = getattr(module, "apply_rotary_pos_emb", None), getattr(module, "rotate_half", None)
    ref = getattr(ml.apply_rotary_pos_emb, "stock", ml.apply_rotary_pos_emb)  # Llama's may be patched already
    return fn is not None and rot is not None and same_source(fn, ref) and same_source(rot, ml.rotate_half)


_BF16 = torch.bfloat16
_DIMS = ctypes.c_int64 * 19


def _native_dims(q, k, cos, sin, unsqueeze_dim, qo, ko):
    """The kernel's dims array (shapes and strides), or None where it does not apply. Kept lean: it runs once
    per layer and token step."""
    if (unsqueeze_dim != 1 or not q.dtype == k.dtype == cos.dtype == sin.dtype == _BF16 or not q.is_cpu
            or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))):
        return None
    qs, ks, cs = q.shape, k.shape, cos.shape
    if len(qs) != 4 or len(ks) != 4 or len(cs) != 3 or sin.shape != cs or qs[3] % 2:
        return None
    if ks[0] != qs[0] or ks[2:] != qs[2:] or cs[1:] != qs[2:] or cs[0] not in (1, qs[0]):
        return None
    qst, kst, cst = q.stride(), k.stride(), cos.stride()
    if qst[3] != 1 or kst[3] != 1 or cst[2] != 1 or sin.stride() != cst or not (k.is_cpu and cos.is_cpu and sin.is_cpu):
        return None
    qos, kos = qo.stride(), ko.stride()
    return _DIMS(qs[0], qs[2], qs[3], qs[1], ks[1], *qst[:3], *qos[:3], *kst[:3], *kos[:3],
                 cst[0] if cs[0] > 1 else 0, cst[1])


def _dispatcher(stock):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if (ops.tracing() and unsqueeze_dim == 1 and q.dtype == k.dtype == cos.dtype == sin.dtype == _BF16
                and q.dim() == k.dim() == 4 and cos.dim() == 3 and q.shape[-1] % 2 == 0):
            return torch.ops.hydraspec.rope(q, k, cos, sin)
        lib = kernels.fused_lib()  # looked up per call: HYDRASPEC_FUSED (or a patched fused_lib) switches it
        if lib is None or q.dtype != _BF16:
            return stock(q, k, cos, sin, unsqueeze_dim)
        qo, ko = torch.empty_like(q), torch.empty_like(k)  # laid out as the inputs, as the stock results are
        dims = _native_dims(q, k, cos, sin, unsqueeze_dim, qo, ko)
        if dims is None:
            return stock(q, k, cos, sin, unsqueeze_dim)
        lib.hs_rope_bf16(q.data_ptr(), qo.data_ptr(), k.data_ptr(), ko.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                         dims)
        return qo, ko

    apply_rotary_pos_emb.stock = stock
    apply_rotary_pos_emb.__doc__ = "hydraspec: the stock rotary embedding, as one native call where it applies."
    return apply_rotary_pos_emb


def rope_is_native(module) -> bool:
    """Whether a modeling module's apply_rotary_pos_emb is hydraspec's dispatcher."""
    return hasattr(getattr(module, "apply_rotary_pos_emb", None), "stock")


def fuse_rope(model: torch.nn.Module) -> int:
    """Put the native rotary embedding into the modeling module of every attention class in ``model`` whose
    apply_rotary_pos_emb is Llama's; returns how many modules now have it (0 without the native kernel)."""
    if kernels.fused_lib() is None:
        return 0
    done = 0
    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        if module is None:
            continue
        if rope_is_native(module):
            done += 1
        elif _is_plain_rope(module):
            module.apply_rotary_pos_emb = _dispatcher(module.apply_rotary_pos_emb)
            done += 1
    return done
