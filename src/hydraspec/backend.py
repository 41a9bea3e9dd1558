"""The one seam between the model-independent layers (heads, training, the bench's report) and the CPU
backend (hydraspec.cpu.kernels and the native code it builds, hydraspec.cpu.gguf, hydraspec.cpu.attention).
Everything above asks here; with the native code off (``HYDRASPEC_NATIVE=0``) or not buildable, every call
still works on stock torch."""
from __future__ import annotations

from torch import nn

__all__ = ["prepack", "unpack", "follow_base", "native_bf16", "describe"]


def prepack(module: nn.Module) -> int:
    """Put the module's CPU Linear layers on the backend's kernels (a no-op without them). Returns how many."""
    from .cpu import kernels

    return kernels.prepack(module)


def unpack(module: nn.Module) -> nn.Module:
    """Back to plain Linear layers sharing the same weights (for modules that are going to be trained)."""
    from .cpu import kernels

    return kernels.unpack(module)


def follow_base(lin: nn.Linear, base: nn.Module) -> nn.Module:
    """``lin`` (rows of ``base``'s weight) on the kernels that ``base`` runs on."""
    from .cpu import kernels

    return kernels.PackedLinear(lin) if isinstance(base, kernels.PackedLinear) else lin


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512_BF16 or AMX)."""
    from .cpu import kernels

    return kernels.cpu_has_bf16()


def describe() -> str:
    """Which native build runs here ("torch" without one), and whether the fused RMSNorm/attention are on."""
    from .cpu import kernels

    text = kernels.describe()
    if text != "torch" and kernels.fused_lib() is None:
        text += ", fused ops off"  # HYDRASPEC_FUSED=0: RMSNorm and attention in torch
    return text
