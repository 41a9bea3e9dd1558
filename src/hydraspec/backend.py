"""The one seam between the model-independent layers (heads, training, the bench's report) and the CPU
backend (hydraspec.cpu: kernels and the native code it builds, gguf, attention, norm, rope, mlp).
Everything above asks here; with the native code off (``HYDRASPEC_NATIVE=0``) or not buildable, every call
still works on stock torch."""
from __future__ import annotations

import platform

import torch
from torch import nn

from .cpu import attention, build, gguf, graph, kernels, mlp, norm, pages, quantized, rope
from .cpu.graph import causal_mask
from .cpu.ops import rotary_at
from .shared_input import fuse_siblings

__all__ = ["causal_mask", "rotary_at", "prepack", "quantize_drafting", "join_w4a8_siblings", "unpack", "follow_base", "fuse_ops",
           "int8_per_row", "W4_GROUPS", "native_bf16", "packed_keyword", "rows_per_pass", "describe", "build_id",
           "cpu_model", "huge_pages", "compile_steps", "release_free_memory"]


def prepack(module: nn.Module) -> int:
    """Put the module's CPU Linear layers on the backend's kernels (a no-op without them). Returns how many."""
    return kernels.prepack(module)


def quantize_drafting(module: nn.Module) -> int:
    """A module that only drafts, bf16 on a CPU with the native int8 kernel: its Linear layers as 4-bit codes
    times int8 activations (``cpu.quantized.W4A8Linear``), as draft models run, and the sibling projections of
    a layer (q/k/v, gate/up) joined into one kernel call each (hydraspec.shared_input: the same outputs).
    Returns how many layers were quantised (0 elsewhere)."""
    p = next(module.parameters(), None)
    if p is None or p.device.type != "cpu" or p.dtype != torch.bfloat16 or kernels.int8_dot_lib() is None:
        return 0
    done = quantized.quantize_w4a8(module)
    join_w4a8_siblings(module)
    return done


def join_w4a8_siblings(module: nn.Module) -> int:
    """The w4a8 sibling projections of each layer (q/k/v, gate/up) joined into one kernel call each
    (hydraspec.shared_input: the same outputs); returns how many joined weights."""
    return fuse_siblings(module, quantized.can_join_w4a8, quantized.W4A8Linear.concat)


def unpack(module: nn.Module) -> nn.Module:
    """Back to plain Linear layers sharing the same weights (for modules that are going to be trained)."""
    return kernels.unpack(module)


def follow_base(lin: nn.Linear, base: nn.Module) -> nn.Module:
    """``lin`` (rows of ``base``'s weight) on the kernels that ``base`` runs on."""
    return kernels.PackedLinear(lin) if isinstance(base, kernels.PackedLinear) else lin


def fuse_ops(model: nn.Module) -> dict[str, int]:
    """Put the model's RMSNorms, rotary embedding and gated MLPs on the backend's fused ops where their stock
    code is Llama's (a no-op without them); returns how many of each."""
    return {"norms": norm.fuse_norms(model), "rope": rope.fuse_rope(model), "mlps": mlp.fuse_mlps(model)}


def huge_pages(model: nn.Module) -> int:
    """Move the model's large CPU tensors into 2 MB pages (hydraspec.cpu.pages; the numbers do not change);
    returns the bytes moved, 0 where huge pages are off or unavailable. The old pages go back to the system."""
    return pages.to_huge_pages(model)


def compile_steps(model: nn.Module) -> str | None:
    """Run the model's one-token forwards as compiled steps (hydraspec.cpu.graph: torch.compile over the stock
    classes, the same kernels and the same numbers); None when done, else why not (the model is unchanged)."""
    return graph.compile_steps(model)


def eager_forward(model: nn.Module):
    """``model``'s forward without its compiled steps (compile_steps), for callers outside decoding that hand
    it caches of their own (a plain transformers cache)."""
    return graph.eager_forward(model)


W4_GROUPS = quantized.W4_GROUPS  # inputs per scale of the 4-bit draft kernels, first fit first


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the system (after a build that left many freed temporaries)."""
    kernels.release_free_memory()


def int8_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] -> int8 codes and one fp32 scale per row (symmetric, absmax / 127), as the int8 kernels
    hold their weights."""
    return quantized.int8_per_row(weight)


def packed_keyword(model: nn.Module) -> str | None:
    """The model-call keyword that runs a packed forward (several cached sequences' new tokens as one
    sequence, see hydraspec.cpu.attention.packed_attention) where the model runs the backend's attention;
    None where it cannot."""
    return attention.PACKED if getattr(model.config, "_attn_implementation", None) == attention.NAME else None


def rows_per_pass(model: nn.Module) -> int | None:
    """Activation rows the kernels of the model's GGUF weights take per pass over each weight (a forward
    over more new tokens goes through the weights again: hydraspec.packed_cost); None for other weights."""
    return gguf.rows_per_pass() if any(isinstance(m, gguf.GGUFLinear) for m in model.modules()) else None


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512_BF16 or AMX)."""
    return kernels.cpu_has_bf16()


def describe() -> str:
    """Which native build runs here ("torch" without one), whether the fused ops (RMSNorm, attention, rotary
    embedding, gated MLP) are on, and how far ahead its kernels prefetch weights (:mod:`hydraspec.cpu.prefetch`)."""
    text = kernels.describe()
    if text != "torch" and kernels.fused_lib() is None:
        text += ", fused ops off"  # HYDRASPEC_FUSED=0: those ops in torch
    ahead = kernels.prefetch_now(kernels.native_lib()) if text != "torch" else None
    if ahead is not None:
        text += f", weights prefetched {ahead} B ahead"
    return text


def build_id() -> str:
    """The native library this process computes with, by file name (it carries a hash of the sources and
    flags), or "torch": a timing taken under one build says nothing about another."""
    isa = kernels.native_isa()
    name = build.library_name(isa) if isa is not None and kernels.native_lib() is not None else None
    return name or "torch"


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (else what ``platform`` knows, else "unknown")."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Hardware", "Processor", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
