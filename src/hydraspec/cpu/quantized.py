"""Draft-model weight formats on the CPU kernels: int8 weights (:class:`Int8Linear`), int8 weights times int8
activations (:class:`W8A8Linear`) and 4-bit weights times int8 activations (:class:`W4A8Linear`), and the
swaps that put a draft model's Linear layers on them. Only drafters are quantised: the target verifies every
drafted token, so these change how many tokens are accepted, never the output. Each runs the native build
(:func:`hydraspec.cpu.kernels.native_lib`, :func:`hydraspec.cpu.kernels.int8_dot_lib`, looked up per call)
or, without it, the same integer arithmetic in torch."""
from __future__ import annotations

import torch
from torch import nn

from . import kernels, ops
from .kernels import PACK_BLOCK, PackedLinear, native_call, release_free_memory

__all__ = ["int8_per_row", "Int8Linear", "quantize_rows", "W8A8Linear", "W4_GROUPS", "W4A8Linear", "can_join_w4a8",
           "quantize_w4a8", "quantize_w8a8", "quantize_int8", "swap_linears"]


def int8_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] weight -> int8 values and one fp32 scale per output (symmetric, absmax/127)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


class Int8Linear(nn.Module):
    """A Linear whose weight is held as int8 with one fp32 scale per output (symmetric, absmax/127),
    for draft models: a bf16 activation row reads half the bytes of bf16 weights. Drafts only propose
    tokens that the unquantised target then verifies, so quantising the drafter changes how many tokens
    are accepted, never what is generated. Falls back to dequantised fp32 math without the native kernel."""

    def __init__(self, lin: nn.Module):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        with torch.no_grad():
            q, scale = int8_per_row(lin.weight)
            pad = (-self.out_features) % PACK_BLOCK
            qp = torch.cat([q, q.new_zeros(pad, self.in_features)]) if pad else q
            self.register_buffer("qweight", qp.view(-1, PACK_BLOCK, self.in_features).transpose(1, 2).contiguous())
            self.register_buffer("scale", scale.contiguous())
            self.register_buffer("bias32", None if lin.bias is None else lin.bias.detach().float().contiguous())

    def dequantized(self) -> torch.Tensor:
        q = self.qweight.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]
        return q.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = kernels.native_lib()
        if lib is not None and x.dtype == torch.bfloat16 and x.is_cpu:
            b = self._buffers  # not self.qweight: a buffer lookup through nn.Module.__getattr__ is slow per call
            return native_call(lib.hs_linear_i8, x, b["qweight"], b["scale"], self.out_features, b["bias32"])
        y = nn.functional.linear(x.float(), self.dequantized(), self.bias32)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


def quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x2 [rows, in] as integers in [-127, 127] (as fp32) and its fp32 scale (absmax/127, 1 for
    an all-zero row), rounded half to even: the arithmetic of the native w8a8 kernel."""
    xf = x2.float()
    amax = xf.abs().amax(-1)
    s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(xf / s[:, None]).clamp_(-127, 127), s


class W8A8Linear(nn.Module):
    """int8 weights (one scale per output, as Int8Linear) times activations quantised to int8 per row on
    the fly, multiplied as integers (AVX512_VNNI's vpdpbusd, 64 multiply-adds an instruction instead of 16,
    or AVX2's vpmaddubsw; :func:`hydraspec.cpu.kernels.int8_dot_lib`): for draft models on CPUs where the int8 kernel is bound by
    arithmetic rather than by memory.
    Only the drafter sees the rounding of its activations; the target verifies every token, so the output
    is unchanged and only acceptance can move. Without the native kernel the same integer arithmetic runs
    in torch (exact, slow)."""

    def __init__(self, lin: nn.Module):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        with torch.no_grad():
            q, scale = int8_per_row(lin.weight)
            pad_o, pad_i = (-self.out_features) % PACK_BLOCK, (-self.in_features) % 4
            qp = nn.functional.pad(q, (0, pad_i, 0, pad_o))
            in4 = qp.shape[1] // 4
            # [blocks, in/4, 32 outputs, 4 inputs]: one 64-byte load feeds vpdpbusd 16 outputs x 4 inputs
            self.register_buffer("qweight", qp.view(-1, PACK_BLOCK, in4, 4).permute(0, 2, 1, 3).contiguous())
            self.register_buffer("wsum", (128 * q.to(torch.int32).sum(1)).to(torch.int32).contiguous())
            self.register_buffer("scale", scale.contiguous())
            self.register_buffer("bias32", None if lin.bias is None else lin.bias.detach().float().contiguous())

    def int_weight(self) -> torch.Tensor:
        """The int8 weight as [out, in]."""
        q = self.qweight.permute(0, 2, 1, 3).reshape(-1, self.qweight.shape[1] * 4)
        return q[: self.out_features, : self.in_features]

    def dequantized(self) -> torch.Tensor:
        return self.int_weight().float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = kernels.int8_dot_lib()
        if lib is not None and x.dtype == torch.bfloat16 and x.is_cpu:
            b = self._buffers
            return native_call(lib.hs_linear_w8a8, x, b["qweight"], b["scale"], self.out_features, b["bias32"],
                                b["wsum"])
        x2 = x.reshape(-1, self.in_features)
        # the kernel's arithmetic: exact integer sums, then the same fp32 products
        q, s = quantize_rows(x2)
        acc = ((q + 128).double() @ self.int_weight().double().T).to(torch.int64) - self.wsum
        y = acc.float() * s[:, None] * self.scale
        if self.bias32 is not None:
            y = y + self.bias32
        y = y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights and activations"


W4_GROUPS = (64, 32)  # inputs per 4-bit scale: the first that divides a layer's input size


_CHUNK_ROWS = 512  # rows of a weight re-quantised at a time


def _weight_rows(lin: nn.Module, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of ``lin``'s weight as ``lin.weight`` gives them (a GGUF weight: its own rows only)."""
    if getattr(lin, "requantizable", False):  # a GGUF weight: dequantize these rows, rounded as its .weight rounds
        rows = torch.arange(r0, min(r1, lin.out_features))
        return lin.dequantized(rows).to(torch.bfloat16)
    return lin.weight.detach()[r0:r1]


class W4A8Linear(nn.Module):
    """4-bit weights (symmetric, one fp32 scale per output and group of `group` inputs) times activations
    quantised to int8 per row, with integer dot products (AVX512_VNNI or AVX2): half the weight bytes of int8 and
    the arithmetic of w8a8 (0.56 bytes per weight with groups of 64), for draft models whose int8 forward
    is bound by memory. As with every draft quantisation only acceptance can move, never the output.
    Without the native kernel the same integer sums run in torch (slow)."""

    def __init__(self, lin: nn.Module, group: int):
        super().__init__()
        self.in_features, self.out_features, self.group = lin.in_features, lin.out_features, group
        if group % 4 or self.in_features % group:
            raise ValueError(f"4-bit groups of {group} inputs do not fit {self.in_features} inputs")
        nblk, half = (self.out_features + PACK_BLOCK - 1) // PACK_BLOCK, PACK_BLOCK // 2
        self.register_buffer("qweight", torch.empty(nblk, self.in_features // 4, half, 4, dtype=torch.uint8))
        self.register_buffer("scale", torch.empty(nblk, self.in_features // group, PACK_BLOCK))
        with torch.no_grad():
            for r0 in range(0, nblk * PACK_BLOCK, _CHUNK_ROWS):  # a chunk of rows at a time: no dense copy of it all
                w = nn.functional.pad(_weight_rows(lin, r0, r0 + _CHUNK_ROWS).float(),
                                      (0, 0, 0, (-min(self.out_features - r0, _CHUNK_ROWS)) % PACK_BLOCK))
                g = w.view(w.shape[0], -1, group)
                scale = (g.abs().amax(-1) / 7.0).clamp_min(1e-12)  # [rows, groups]
                q = (torch.round(g / scale[..., None]).clamp_(-8, 7) + 8).to(torch.uint8).view(w.shape)
                qb = q.view(-1, PACK_BLOCK, self.in_features // 4, 4).permute(0, 2, 1, 3)  # [blocks, in/4, 32, 4]
                b0 = r0 // PACK_BLOCK
                self.qweight[b0:b0 + qb.shape[0]] = qb[:, :, :half] | (qb[:, :, half:] << 4)
                self.scale[b0:b0 + qb.shape[0]] = scale.view(-1, PACK_BLOCK, scale.shape[1]).transpose(1, 2)
            self.register_buffer("bias32", None if lin.bias is None else lin.bias.detach().float().contiguous())

    def int_weight(self) -> torch.Tensor:
        """The 4-bit weight as integers in [-8, 7], [out, in]."""
        qb = torch.cat([self.qweight & 15, self.qweight >> 4], dim=2).to(torch.int32) - 8  # [blocks, in/4, 32, 4]
        return qb.permute(0, 2, 1, 3).reshape(-1, self.in_features)[: self.out_features]

    def group_scales(self) -> torch.Tensor:
        """[out, groups] fp32."""
        return self.scale.transpose(1, 2).reshape(-1, self.scale.shape[1])[: self.out_features]

    def dequantized(self) -> torch.Tensor:
        return self.int_weight().float() * self.group_scales().repeat_interleave(self.group, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.tracing() and x.dtype == torch.bfloat16:
            b = self._buffers
            return torch.ops.hydraspec.w4a8_linear(x, b["qweight"], b["scale"], b["bias32"], self.group, self.out_features)
        lib = kernels.int8_dot_lib()
        if lib is not None and x.dtype == torch.bfloat16 and x.is_cpu:
            b = self._buffers
            return native_call(lib.hs_linear_w4a8, x, b["qweight"], b["scale"], self.out_features, b["bias32"],
                                group=self.group)
        x2 = x.reshape(-1, self.in_features)
        # the kernel's arithmetic: exact integer sums per group, scaled and added in group order
        q, s = quantize_rows(x2)
        w, gs = self.int_weight().double(), self.group_scales()
        y = torch.zeros(x2.shape[0], self.out_features)
        for k, i in enumerate(range(0, self.in_features, self.group)):
            part = (q[:, i:i + self.group].double() @ w[:, i:i + self.group].T).float()
            y = y + part * gs[:, k]
        y = y * s[:, None]
        if self.bias32 is not None:
            y = y + self.bias32
        y = y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    @classmethod
    def concat(cls, parts: list["W4A8Linear"]) -> "W4A8Linear":
        """One W4A8Linear whose outputs are those of ``parts`` one after another (same input size and group,
        every part but the last a whole number of 32-row blocks: see :func:`can_join_w4a8`). The codes and
        scales are the parts' own, so each output is computed exactly as its part computes it."""
        if not can_join_w4a8(parts):
            raise ValueError("these 4-bit weights differ in input size or group, or are not block-aligned")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        first = parts[0]
        self.in_features, self.out_features, self.group = first.in_features, sum(p.out_features for p in parts), first.group
        self.register_buffer("qweight", torch.cat([p.qweight for p in parts]))
        self.register_buffer("scale", torch.cat([p.scale for p in parts]))
        biases = [p.bias32 for p in parts]
        self.register_buffer("bias32", None if all(b is None for b in biases) else torch.cat(
            [torch.zeros(p.out_features) if b is None else b for p, b in zip(parts, biases)]))
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, 4-bit weights (groups of "
                f"{self.group}), int8 activations")


def can_join_w4a8(parts: list[nn.Module]) -> bool:
    """Whether :meth:`W4A8Linear.concat` can join ``parts``: all W4A8Linear with one input size and group,
    every part but the last a whole number of 32-row blocks."""
    return (len(parts) > 1 and all(type(p) is W4A8Linear for p in parts)
            and len({(p.in_features, p.group) for p in parts}) == 1
            and all(p.out_features % PACK_BLOCK == 0 for p in parts[:-1]))


def quantize_w4a8(model: nn.Module) -> int:
    """Swap every Linear / PackedLinear inside `model` for a W4A8Linear, or a W8A8Linear where no group size
    of W4_GROUPS divides the layer's inputs (draft models only). Returns how many."""
    def make(lin):
        for g in W4_GROUPS:
            if lin.in_features % g == 0:
                return W4A8Linear(lin, g)
        return W8A8Linear(lin)

    return swap_linears(model, make)


def quantize_w8a8(model: nn.Module) -> int:
    """Swap every Linear / PackedLinear inside `model` for a W8A8Linear (draft models only). Returns how many."""
    return swap_linears(model, W8A8Linear)


def quantize_int8(model: nn.Module) -> int:
    """Swap every Linear / PackedLinear inside `model` for an Int8Linear (draft models only: the target
    must stay unquantised for the output to be the target's). Returns how many."""
    return swap_linears(model, Int8Linear)


def swap_linears(model: nn.Module, make) -> int:
    todo = []
    for mod in model.modules():
        if hasattr(mod, "num_embeddings"):  # an embedding's GGUF table: rows are looked up, not multiplied
            continue
        for child_name, child in mod.named_children():
            if getattr(child, "requantizable", False):  # a GGUF weight (CPU only): .weight would be a dense copy
                todo.append((mod, child_name, child))
            elif type(child) in (nn.Linear, PackedLinear) and child.weight.device.type == "cpu":
                todo.append((mod, child_name, child))
    for i in range(len(todo)):  # each old weight is let go as soon as its replacement is in
        parent, child_name, child = todo[i]
        todo[i] = None
        setattr(parent, child_name, make(child))
        del child
        if i % 16 == 15:
            release_free_memory()
    return len(todo)
