"""The Llama-kind RMSNorm (Zhang & Sennrich 2019, as Llama, Qwen2, Mistral, SmolLM ... compute it) as one
native call (``hs_rmsnorm`` in csrc/hs_ops.h) instead of eight torch operations; its arithmetic is the stock
module's (statistics in fp32, the normalised row rounded to the input dtype before the weight multiplies
it), so the result equals the stock module's (tested)."""
from __future__ import annotations

import torch
import transformers
from torch import nn

from . import kernels, ops
from .stock import same_source

__all__ = ["FusedRMSNorm", "fuse_norms"]


class FusedRMSNorm(nn.Module):
    """The Llama/Qwen2/Mistral RMSNorm (``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, statistics in
    fp32) as one native call (``hs_rmsnorm`` in csrc/hs_ops.h) instead of 8 torch operations. Shares the
    stock module's weight; runs the stock class's own forward when gradients are on, for other dtypes,
    or without the kernel."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)
        self._stock_forward = type(norm).forward  # reads only .weight and .variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if ops.tracing() and x.dtype == w.dtype and x.dtype in (torch.float32, torch.bfloat16):
            return torch.ops.hydraspec.rmsnorm(x, w, self.variance_epsilon)
        lib = kernels.fused_lib()
        if (lib is not None and x.dtype == w.dtype and x.dtype in (torch.float32, torch.bfloat16)
                and x.is_cpu and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
                and x.is_contiguous() and x.numel()):  # a Parameter is contiguous
            y = torch.empty_like(x)
            lib.hs_rmsnorm(x.data_ptr(), w.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
                           self.variance_epsilon, x.dtype == torch.bfloat16, y.data_ptr(), torch.get_num_threads())
            return y
        return self._stock_forward(self, x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, native"


def _plain_rmsnorm(cls: type) -> bool:
    """Whether an RMSNorm class computes exactly what FusedRMSNorm does: its forward is Llama's."""
    return same_source(cls.forward, transformers.models.llama.modeling_llama.LlamaRMSNorm.forward)


def fuse_norms(model: nn.Module) -> int:
    """Swap every CPU RMSNorm of the Llama kind inside `model` for a FusedRMSNorm (same weight; the
    state dict does not change). Returns how many; 0 without the native kernel. Other norms (Gemma's
    ``1 + weight``, LayerNorm) stay as they are."""
    if kernels.fused_lib() is None:
        return 0
    todo = []
    for mod in model.modules():
        for name, child in mod.named_children():
            if not hasattr(child, "variance_epsilon"):  # before .weight: some modules compute theirs
                continue
            w = getattr(child, "weight", None)
            if (isinstance(w, torch.Tensor) and w.device.type == "cpu" and w.ndim == 1
                    and _plain_rmsnorm(type(child))):
                todo.append((mod, name, child))
    for parent, name, child in todo:
        setattr(parent, name, FusedRMSNorm(child))
    return len(todo)
