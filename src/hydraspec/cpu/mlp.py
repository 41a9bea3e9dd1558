"""The gated MLP of the stock decoder layers (``down(silu(gate(x)) * up(x))``: Llama, Qwen2, Mistral,
SmolLM ...; the SwiGLU of Shazeer 2020) with its elementwise part as one native call
(``hs_silu_mul_bf16`` in csrc/hs_ops.h) instead of two column views, a SiLU and a product.

Where gate and up were joined into one weight (:mod:`hydraspec.shared_input`), the native call reads the
two halves of the joined output in place. The SiLU is computed as ``x / (1 + e^-x)`` in fp32 and rounded to
bf16 before the product, as the stock module rounds it; its exponential is not torch's, so a value may
differ from the stock module's in the last bit of bf16 (tested to stay within that). Every element is
computed on its own, so a row's result does not depend on the other rows of the forward, and speculative
decoding stays token for token equal to plain decoding with the same module.
"""
from __future__ import annotations

import torch
import transformers
from torch import nn

from . import kernels, ops
from .stock import same_source

__all__ = ["FusedGatedMLP", "fuse_mlps"]


def _plain_mlp(cls: type) -> bool:
    """Whether an MLP class's forward is Llama's ``down(act(gate(x)) * up(x))``."""
    # (transformers' modules load on first use: the stock classes are read here, not at import)
    return same_source(cls.forward, transformers.models.llama.modeling_llama.LlamaMLP.forward)


def _is_silu(act: nn.Module) -> bool:
    return type(act) in (transformers.activations.SiLUActivation, nn.SiLU)


def _joined_pair(gate: nn.Module, up: nn.Module):
    """The joined weight behind gate and up when they are the two halves of one two-part shared input (a
    :class:`hydraspec.shared_input.Projection` exposes ``shared`` and ``part``; its shared input ``joined``
    and ``bounds``), else None."""
    sg, su = getattr(gate, "shared", None), getattr(up, "shared", None)
    if sg is None or sg is not su or getattr(gate, "part", None) != 0 or getattr(up, "part", None) != 1:
        return None
    bounds = getattr(sg, "bounds", None)
    if bounds is None or len(bounds) != 2 or bounds[0][1] - bounds[0][0] != bounds[1][1] - bounds[1][0]:
        return None
    return sg.joined


class FusedGatedMLP(nn.Module):
    """Stands in for a stock gated MLP: the same submodules (so the same state dict), the elementwise part
    native for bf16 CPU inputs without gradients, the stock class's own forward otherwise."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn
        self.intermediate = mlp.down_proj.in_features
        self._stock_forward = type(mlp).forward  # reads only the four submodules
        # (gate, up) as last seen and the joined weight behind them; plain attributes, not submodules
        object.__setattr__(self, "_pair", None)
        object.__setattr__(self, "_joined", None)

    def _joined_weight(self):
        """The joined gate/up weight, looked up again only when gate or up has been replaced."""
        pair = (self.gate_proj, self.up_proj)
        if self._pair is None or pair[0] is not self._pair[0] or pair[1] is not self._pair[1]:
            object.__setattr__(self, "_pair", pair)
            object.__setattr__(self, "_joined", _joined_pair(*pair))
        return self._joined

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.tracing() and x.dtype == torch.bfloat16:
            joined = self._joined_weight()
            inter = self.intermediate
            if joined is not None:
                g = joined(x)
                return self.down_proj(torch.ops.hydraspec.silu_mul(g[..., :inter], g[..., inter:]))
            return self.down_proj(torch.ops.hydraspec.silu_mul(self.gate_proj(x), self.up_proj(x)))
        lib = kernels.fused_lib()  # looked up per call: HYDRASPEC_FUSED (or a patched fused_lib) switches it
        if lib is None or x.dtype != torch.bfloat16 or not x.is_cpu or (torch.is_grad_enabled() and x.requires_grad):
            return self._stock_forward(self, x)
        inter = self.intermediate
        joined = self._joined_weight()
        if joined is not None:  # gate and up: the two halves of one output, read in place
            g = joined(x)
            u, stride = g[..., inter:], 2 * inter
        else:
            g, u, stride = self.gate_proj(x), self.up_proj(x), inter
        if not (g.dtype == u.dtype == torch.bfloat16 and g.is_contiguous() and (joined is not None or u.is_contiguous())):
            return self.down_proj(self.act_fn(g[..., :inter]) * u)  # the stock arithmetic on what was computed
        h = torch.empty(*x.shape[:-1], inter, dtype=torch.bfloat16)
        lib.hs_silu_mul_bf16(g.data_ptr(), stride, u.data_ptr(), stride, g.numel() // g.shape[-1], inter, h.data_ptr(),
                             torch.get_num_threads())
        return self.down_proj(h)

    def extra_repr(self) -> str:
        return "silu(gate) * up native"


def fuse_mlps(model: nn.Module) -> int:
    """Swap every CPU gated MLP of the Llama kind with a SiLU inside ``model`` for a FusedGatedMLP (same
    submodules, same state dict). Returns how many; 0 without the native kernel."""
    if kernels.fused_lib() is None:
        return 0
    todo = []
    for mod in model.modules():
        for name, child in mod.named_children():
            if (all(isinstance(getattr(child, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
                    and _plain_mlp(type(child)) and _is_silu(child.act_fn)):
                todo.append((mod, name, child))
    for parent, name, child in todo:
        setattr(parent, name, FusedGatedMLP(child))
    return len(todo)
