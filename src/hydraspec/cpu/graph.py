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
forwards stay eager, so one graph per model is compiled (about a minute on two cores, once per process).
The operator library is compiled with the system C++ compiler against the installed torch on first use
(into the hydraspec home); without a compiler, torch's headers or the native kernels, nothing is compiled
and every step runs eagerly as before.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

import torch

from ..home import hydraspec_home

__all__ = ["available", "tracing", "compile_steps", "rotary"]

_SOURCE = Path(__file__).with_name("csrc") / "hs_torch_ops.cpp"
_loaded = False
_rotaries: list = []  # the rotary modules behind hydraspec::rotary, by index
_lock = threading.Lock()


def _library_path() -> tuple[Path, list[str]]:
    from torch.utils import cpp_extension

    flags = ["-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    flags += [f"-I{p}" for p in cpp_extension.include_paths()]
    flags += [f"-L{p}" for p in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu", "-ltorch"]
    key = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode() + " ".join(flags).encode()).hexdigest()[:16]
    return hydraspec_home() / "kernels" / f"hs_torch_ops-{key}.so", flags


def _build() -> tuple[Path | None, str]:
    so, flags = _library_path()
    if so.exists():
        return so, ""
    cxx = os.environ.get("CXX", "c++")
    try:
        so.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
            tmp_so = Path(tmp) / so.name
            res = subprocess.run([cxx, str(_SOURCE), *flags, "-o", str(tmp_so)], capture_output=True, text=True)
            if res.returncode:
                return None, res.stderr.strip()[-300:]
            os.replace(tmp_so, so)
            return so, ""
    except (OSError, subprocess.SubprocessError) as exc:
        return None, str(exc)


def _register_fakes() -> None:
    reg = torch.library.register_fake

    @reg("hydraspec::gguf_linear")
    def _(x, call, out):
        return x.new_empty(*x.shape[:-1], out)

    @reg("hydraspec::gguf_rows")
    def _(ids, call, dim):
        return torch.empty(*ids.shape, dim, dtype=torch.bfloat16, device=ids.device)

    @reg("hydraspec::w4a8_linear")
    def _(x, qweight, scale, bias, group, out):
        return x.new_empty(*x.shape[:-1], out)

    @reg("hydraspec::attention")
    def _(q, k, v, mask, scale):
        return q.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[-1])

    @reg("hydraspec::rmsnorm")
    def _(x, w, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @reg("hydraspec::rope")
    def _(q, k, cos, sin):
        return torch.empty_like(q), torch.empty_like(k)

    @reg("hydraspec::silu_mul")
    def _(g, u):
        return g.new_empty(g.shape)


@torch.library.custom_op("hydraspec::rotary", mutates_args=())
def rotary(x: torch.Tensor, position_ids: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin of rotary module ``index`` (registered by :func:`compile_steps`), computed eagerly by its
    own stock forward."""
    cos, sin = _rotaries[index].hs_eager_forward(x, position_ids)
    return cos.clone(), sin.clone()


@rotary.register_fake
def _(x, position_ids, index):
    mod = _rotaries[index]
    dim = mod.inv_freq.shape[-1] * 2
    shape = (position_ids.shape[0], position_ids.shape[1], dim)
    return x.new_empty(shape), x.new_empty(shape)


@lru_cache(maxsize=1)
def available() -> str | None:
    """Load the operator library (building it on first use) and hand it the kernels; None when ready, else
    why not."""
    global _loaded
    from . import kernels  # (kernels imports this module)

    gguf_lib, fused = kernels.int8_dot_lib(), kernels.fused_lib()
    if gguf_lib is None or fused is None or not hasattr(gguf_lib, "hs_gguf_apply"):
        return "the native CPU kernels are not available here"
    so, err = _build()
    if so is None:
        return f"the compiled-step operators could not be built ({err or 'no C++ compiler'})"
    torch.ops.load_library(str(so))
    addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
    torch.ops.hydraspec.bind([addr(gguf_lib.hs_gguf_apply), addr(gguf_lib.hs_gguf_rows), addr(fused.hs_attention),
                              addr(fused.hs_rmsnorm), addr(fused.hs_rope_bf16), addr(fused.hs_silu_mul_bf16),
                              addr(gguf_lib.hs_linear_w4a8)])
    _register_fakes()
    _loaded = True
    return None


def tracing() -> bool:
    """Whether the code running now is being traced for a compiled step (the modules then call the
    ``hydraspec`` operators instead of their ctypes calls)."""
    return _loaded and torch.compiler.is_compiling()


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
    else why not (the model is then left as it was). The first such step compiles (about a minute for a
    1.5B model on two cores)."""
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
            with _lock:
                _rotaries.append(m)
                index = len(_rotaries) - 1
            eager = m.forward
            m.hs_eager_forward = eager

            def forward(x, position_ids, *rest, _index=index, _eager=eager):
                if tracing() and not rest:
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

