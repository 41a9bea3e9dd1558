"""Compiled decode steps: the stock model's forward under ``torch.compile`` (TorchInductor) with the native
kernels as PyTorch operators inside the graph.

A decode step of a 4-bit model on a CPU spends 5-8 ms of its ~35-40 ms in Python between the ~200 native
calls (module calls, views, residual adds, the cache write, transformers' own bookkeeping). Inductor
traces the stock transformers classes once and replaces that Python with one generated wrapper
(PyTorch 2, Ansel et al., ASPLOS 2024). Dynamo cannot trace a ctypes call, so the native kernels are also
registered as operators (``csrc/hs_torch_ops.cpp``, namespace ``hydraspec``) that call the same C
functions with the same arguments, and the rotary embedding's cos/sin are computed by the stock module
behind an opaque operator. Every number is therefore computed by the same code as in an eager step:
a compiled step returns the same logits bit for bit (tested); only the Python between the kernels goes.

Only one-token steps (plain decoding, a draft model's chain steps) are compiled; prefill and verify
forwards stay eager, so one graph per model is compiled (30-40 s on two cores, once per process).
The operator library is compiled with the system C++ compiler against the installed torch on first use
(into the hydraspec home); without a compiler, torch's headers or the native kernels, nothing is compiled
and every step runs eagerly as before.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from . import ops

__all__ = ["available", "compile_steps"]


@lru_cache(maxsize=1)
def available() -> str | None:
    """Load the operator library (building it on first use) and hand it the kernels; None when ready, else
    why not."""
    from . import kernels

    gguf_lib, fused = kernels.int8_dot_lib(), kernels.fused_lib()
    if gguf_lib is None or fused is None or not hasattr(gguf_lib, "hs_gguf_apply"):
        return "the native CPU kernels are not available here"
    addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
    return ops.load([addr(gguf_lib.hs_gguf_apply), addr(gguf_lib.hs_gguf_rows), addr(fused.hs_attention),
                     addr(fused.hs_rmsnorm), addr(fused.hs_rope_bf16), addr(fused.hs_silu_mul_bf16),
                     addr(gguf_lib.hs_linear_w4a8)])


# the keywords of hydraspec's own model calls (hydraspec.verify); other callers (transformers' generate) run eagerly
_STEP_KEYWORDS = {"input_ids", "position_ids", "attention_mask", "past_key_values", "use_cache", "output_hidden_states",
                  "logits_to_keep"}
# the hydraspec modules whose forwards the compiled steps can trace (the others call ctypes only)
_TRACEABLE = {"GGUFLinear", "GGUFEmbedding", "W4A8Linear", "DraftVocabHead", "FusedRMSNorm", "FusedGatedMLP",
              "SharedInput", "Projection"}


def _one_token(kwargs) -> bool:
    ids = kwargs.get("input_ids")
    return (ids is not None and ids.dim() == 2 and ids.shape[1] == 1 and not kwargs.get("output_hidden_states")
            and kwargs.keys() <= _STEP_KEYWORDS)


def _untraceable(model) -> str | None:
    for m in model.modules():
        cls = type(m)
        if cls.__module__.startswith("hydraspec.") and cls.__name__ not in _TRACEABLE:
            return cls.__name__
    return None


def compile_steps(model: torch.nn.Module) -> str | None:
    """Make ``model``'s one-token forwards compiled steps (see the module docstring); returns None when done,
    else why not (the model is then left as it was). The first such step compiles (30-40 s for the 0.5B
    and 1.5B models on two cores)."""
    from .gguf import GGUFLinear
    from .kernels import W4A8Linear

    if getattr(model, "hs_compiled", False):
        return None
    why = available()
    if why is not None:
        return why
    if model.device.type != "cpu" or model.dtype != torch.bfloat16:
        return "compiled steps need a bf16 model on the CPU"
    if not any(isinstance(m, (GGUFLinear, W4A8Linear)) for m in model.modules()):
        return "compiled steps run models at a GGUF file's own precision (--quant gguf) or w4a8 drafts"
    bad = _untraceable(model)
    if bad is not None:
        return f"compiled steps cannot trace {bad} modules"
    for m in model.modules():
        if isinstance(m, GGUFLinear):
            m.call_tensor()
        if type(m).__name__.endswith("RotaryEmbedding") and hasattr(m, "inv_freq") and not hasattr(m, "hs_eager_forward"):
            index = ops.register_rotary(m)
            eager = m.forward
            m.hs_eager_forward = eager

            def forward(x, position_ids, *rest, _index=index, _eager=eager):
                if ops.tracing() and not rest:
                    return torch.ops.hydraspec.rotary(x, position_ids, _index)
                return _eager(x, position_ids, *rest)
            m.forward = forward
    eager_forward = model.forward
    compiled = torch.compile(eager_forward, dynamic=True)

    def forward(*args, **kwargs):
        if not args and _one_token(kwargs) and not torch.is_grad_enabled():
            return compiled(**kwargs)
        return eager_forward(*args, **kwargs)
    model.forward = forward
    model.hs_compiled = True
    return None

