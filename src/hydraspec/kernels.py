"""Faster CPU matmuls for the stock model classes: oneDNN-prepacked Linear weights.

A plain `nn.Linear` on CPU repacks its weight into the GEMM kernel's blocked layout on every call;
for the few rows of a decoding step that repacking, not the arithmetic or the weight read, dominates.
`prepack(model)` swaps each Linear leaf module for one that holds its weight prepacked once (the
model classes themselves stay the stock transformers ones). Measured on a 2-core AVX-512 CPU without
native bf16, per [8960 x 1536] weight: fp32 costs about the same for 1..8 rows (memory bound, as
speculative decoding assumes) instead of growing with the rows; bf16 single rows get ~1.6x faster.
Row counts where the plain kernel measured faster keep using it. The results equal plain Linear up to float rounding.
"""
from __future__ import annotations

import torch
from torch import nn


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight = lin.weight  # kept: tied embeddings and shared-lm_head draft heads read it
        self.bias = lin.bias
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), None)
        # row counts where the plain kernel measured faster (2-core AVX-512 CPU, no native bf16)
        self.plain_rows = (2, 3) if lin.weight.dtype == torch.bfloat16 else (1, 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] in self.plain_rows or x.dtype != self.weight.dtype or torch.is_grad_enabled():
            return nn.functional.linear(x, self.weight, self.bias)
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked"


def prepack(model: nn.Module) -> int:
    """Swap every CPU nn.Linear (fp32/bf16) inside `model` for a PackedLinear. Returns how many."""
    if not available():
        return 0
    todo = []
    for name, mod in model.named_modules():
        for child_name, child in mod.named_children():
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and \
                    child.weight.dtype in (torch.float32, torch.bfloat16):
                todo.append((mod, child_name, child))
    for parent, child_name, child in todo:
        setattr(parent, child_name, PackedLinear(child))
    return len(todo)
