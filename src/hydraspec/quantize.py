"""Draft-model quantisation on the CPU backend: a draft model's Linear weights held as int8, or as int8 / 4-bit
codes multiplied with int8 activations (hydraspec.cpu.quantized's Int8Linear, W8A8Linear, W4A8Linear).

Guarantee: only drafters are quantised. In speculative decoding (Leviathan et al. 2023) the verified output
comes from the unquantised target, so quantising a draft changes how many draft tokens are accepted, never
the generated text.
"""
from __future__ import annotations

from .backend import join_w4a8_siblings
from .cpu import kernels, quantized
from .errors import HydraspecError

__all__ = ["DRAFT_QUANT", "auto_draft_quant", "quantize_draft"]

DRAFT_QUANT = ("none", "int8", "w8a8", "w4a8")


def auto_draft_quant(weights: str) -> str:
    """What ``--draft-quant auto`` means for a draft whose weights load as ``weights`` ("gguf": a GGUF model
    on the CPU, see models.resolve_quant; "none" otherwise): 4-bit codes re-quantised from the file's own
    values (w4a8, the measured fast default) where the native kernel runs, else the file's precision; "none"
    stays "none"."""
    if weights != "gguf":
        return weights
    return "w4a8" if kernels.int8_dot_lib() is not None else "gguf"


def quantize_draft(model, how: str | None):
    """Quantise a draft model's Linear weights in place (``how``: none | int8 | w8a8 | w4a8, see
    hydraspec.cpu.quantized.Int8Linear / W8A8Linear / W4A8Linear); returns the model. With w4a8 the sibling
    projections of a layer (q/k/v, gate/up) are then joined into one weight each (hydraspec.shared_input)."""
    if how in (None, "none"):
        return model
    if how not in DRAFT_QUANT:
        raise HydraspecError(f"unknown draft quantisation '{how}' (known: {', '.join(DRAFT_QUANT)})")
    if next(model.parameters()).device.type != "cpu":
        raise HydraspecError(f"--draft-quant {how} runs on the CPU kernel only; drop it for GPU drafters")
    if how in ("w8a8", "w4a8") and kernels.int8_dot_lib() is None:
        raise HydraspecError(f"--draft-quant {how} needs the native CPU kernel (AVX2 or AVX512_VNNI and a C "
                             "compiler); use int8")
    {"int8": quantized.quantize_int8, "w8a8": quantized.quantize_w8a8, "w4a8": quantized.quantize_w4a8}[how](model)
    if how == "w4a8":  # q/k/v and gate/up in one kernel call each, as at the file's precision
        join_w4a8_siblings(model)
    kernels.release_free_memory()  # the replaced weights' pages
    return model
