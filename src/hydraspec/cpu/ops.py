"""The native kernels as PyTorch operators (``csrc/hs_torch_ops.cpp``, namespace ``hydraspec``) for compiled
steps (:mod:`hydraspec.cpu.graph`): built with the system C++ compiler against the installed torch on first
use (into the hydraspec home), loaded, and handed the kernel library's C functions by address. The modules
that call kernels ask :func:`tracing` whether to call these operators instead of their ctypes calls.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ..home import hydraspec_home

__all__ = ["load", "tracing", "register_rotary", "rotary", "rotary_at"]

_SOURCE = Path(__file__).with_name("csrc") / "hs_torch_ops.cpp"
_loaded = False
_rotaries: list = []  # the rotary modules behind hydraspec::rotary, by index
_lock = threading.Lock()


def _library_path() -> tuple[Path, list[str]]:
    from torch.utils import cpp_extension  # heavy

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
    """The cos/sin of rotary module ``index`` (registered by :func:`compile_steps`), as its own stock forward
    computes them (:func:`rotary_at`)."""
    cos, sin = rotary_at(_rotaries[index], x, position_ids)
    return cos.clone(), sin.clone()


@rotary.register_fake
def _(x, position_ids, index):
    mod = _rotaries[index]
    dim = mod.inv_freq.shape[-1] * 2
    shape = (position_ids.shape[0], position_ids.shape[1], dim)
    return x.new_empty(shape), x.new_empty(shape)


def load(kernel_addresses: list[int]) -> str | None:
    """Build (once) and load the operator library and bind it to the kernels' C functions (hs_gguf_apply,
    hs_gguf_rows, hs_attention, hs_rmsnorm, hs_rope_bf16, hs_silu_mul_bf16, hs_linear_w4a8, by address);
    None when ready, else why not."""
    global _loaded
    so, err = _build()
    if so is None:
        return f"the compiled-step operators could not be built ({err or 'no C++ compiler'})"
    torch.ops.load_library(str(so))
    torch.ops.hydraspec.bind(kernel_addresses)
    if not _loaded:
        _register_fakes()
    _loaded = True
    return None


ROTARY_BLOCK = 1024  # positions a rotary table grows by


def rotary_at(module, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``module(x, position_ids)`` for a rotary-embedding module: the (cos, sin) [B, n, dim] at ``position_ids``
    [B, n], looked up in a table of every position below the highest asked for, kept on the module and computed
    by its own stock forward ROTARY_BLOCK positions at a time; the same values bit for bit (tested). Computing
    them each step cost a compiled step 0.2 ms and a drafting head's step an eighth (BENCHMARKS.md). Computed
    directly under autograd (no table joins a graph) and where the frequencies follow the length (dynamic and
    LongRoPE scaling)."""
    forward = getattr(module, "hs_eager_forward", module)
    kind = str(getattr(module, "rope_type", "default"))
    if torch.is_grad_enabled() or position_ids.numel() == 0 or "dynamic" in kind or kind == "longrope":
        return forward(x, position_ids)
    need = int(position_ids.max()) + 1
    table = getattr(module, "hs_rotary_table", None)
    if table is None or table[0] != (x.dtype, x.device) or table[1].shape[0] < need:
        size = -(-need // ROTARY_BLOCK) * ROTARY_BLOCK
        cos, sin = forward(x, torch.arange(size, device=x.device)[None])
        table = module.hs_rotary_table = ((x.dtype, x.device), cos[0], sin[0])
    return table[1][position_ids], table[2][position_ids]


def register_rotary(module) -> int:
    """Put a rotary-embedding module behind :func:`rotary`; returns its index."""
    with _lock:
        _rotaries.append(module)
        return len(_rotaries) - 1


def tracing() -> bool:
    """Whether the code running now is being traced for a compiled step (the modules then call the
    ``hydraspec`` operators instead of their ctypes calls)."""
    return _loaded and torch.compiler.is_compiling()
