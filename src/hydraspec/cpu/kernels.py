"""Faster CPU matmuls for the stock model classes: oneDNN-prepacked Linear weights, and a native kernel for
bf16 weights on AVX-512 and AVX2 CPUs, with the loading of the native builds that every CPU layer uses.

A plain `nn.Linear` on CPU repacks its weight into the GEMM kernel's blocked layout on every call;
for the few rows of a decoding step that repacking, not the arithmetic or the weight read, dominates.
`prepack(model)` swaps each Linear leaf module for one that holds its weight prepacked once (the
model classes themselves stay the stock transformers ones), so a float32 weight costs about the same for
1..8 rows (memory bound, as speculative decoding assumes) instead of growing with the rows. Row counts
where the plain kernel is faster keep using it. The results equal plain Linear up to float rounding.

bf16 weights with more rows are the weak spot of oneDNN on CPUs that emulate bf16: its cost grows
with every row, which defeats speculative verification. `csrc/bf16_linear.c` packs each bf16 weight once
into blocks of 32 outputs and multiplies it with 12 fp32 activation rows at a time while reading the weight
once per call (and the draft formats of :mod:`hydraspec.cpu.quantized` do the same with int8 and 4-bit
weights). On CPUs with AVX512_BF16 the bf16 weights are packed in input pairs for vdpbf16ps instead, twice
the arithmetic per instruction. `pip install` compiles it with the system C compiler (`prebuilt/`); without
that build it is compiled on first use into the hydraspec home (`kernels/`). It is used when the CPU has
AVX-512 (set HYDRASPEC_NATIVE=0 to turn it off). CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2/3, older
Intel) get `csrc/avx2_linear.c` instead: bf16 and int8 weights and the w8a8/w4a8 draft formats, in the
same layouts and with the same sums (there oneDNN refuses to prepack bf16 weights, and torch's plain
bf16 matmul grows with every row). The scalar parts of both builds live in `csrc/hs_common.h`. Without a
compiler or either instruction set everything falls back to torch, only slower. The timings behind these
choices are in docs/cpu-kernels.md ("Measurements behind the code").
"""
from __future__ import annotations

import ctypes
import os
import time
import warnings
from contextlib import contextmanager
from functools import lru_cache, wraps
from pathlib import Path

import torch
from torch import nn

from ..errors import HydraspecError
from ..home import hydraspec_home
from .build import compile_library, library_name, prebuilt_dir


@lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first if ":" in line)}


@lru_cache(maxsize=1)
def _cpu_flags() -> set[str]:
    return set(_cpuinfo().get("flags", "").split())


def cpu_identity() -> str:
    """This CPU's vendor, family, model number and name (model names alone repeat across generations)."""
    info = _cpuinfo()
    return " / ".join(info.get(k, "") for k in ("vendor_id", "cpu family", "model", "model name"))


def _cpu_model() -> tuple[str, int]:
    """(vendor, family) of this CPU (("", 0) where unknown)."""
    family = _cpuinfo().get("cpu family", "")
    return _cpuinfo().get("vendor_id", ""), int(family) if family.isdigit() else 0


PREFETCH_BYTES = {("AuthenticAMD", 26): 4096}  # (vendor, family) -> bytes ahead where measured (BENCHMARKS.md)
DEFAULT_PREFETCH_BYTES = 1024


def prefetch_bytes() -> int:
    """How far ahead the 4-bit and GGUF kernels prefetch their weights on this CPU: HYDRASPEC_PREFETCH_BYTES, else
    the distance measured for this CPU family (PREFETCH_BYTES; docs/cpu-kernels.md), else 1024."""
    env = os.environ.get("HYDRASPEC_PREFETCH_BYTES")
    if env is not None:
        if not env.isdigit():
            raise HydraspecError(f"HYDRASPEC_PREFETCH_BYTES must be a number of bytes, got {env!r}")
        return int(env)
    return PREFETCH_BYTES.get(_cpu_model(), DEFAULT_PREFETCH_BYTES)


_PREFETCH: dict = {}  # library handle -> the distance last set


def set_prefetch(lib, nbytes: int | None = None) -> None:
    """The prefetch distance of ``lib``'s 4-bit and GGUF kernels (None: :func:`prefetch_bytes`). Read at every call,
    so it applies to compiled steps too."""
    if hasattr(lib, "hs_prefetch_ahead"):  # (an older build, loaded to time against, may lack it)
        nbytes = prefetch_bytes() if nbytes is None else int(nbytes)
        lib.hs_prefetch_ahead(nbytes)
        _PREFETCH[lib._handle] = nbytes


def prefetch_now(lib) -> int | None:
    """The distance ``lib``'s kernels prefetch at now (None: a build without the setting)."""
    return _PREFETCH.get(lib._handle)


_ISA_FLAGS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "fma"}, "avx2": {"avx2", "fma"}}  # best first


def cpu_runs(isa: str) -> bool:
    """Whether this CPU can run the native kernel's `isa` build ('avx512' or 'avx2')."""
    return _ISA_FLAGS[isa] <= _cpu_flags()


def native_isa() -> str | None:
    """Which build of the native kernel this CPU runs: 'avx512' (csrc/bf16_linear.c: bf16 and int8
    weights, w8a8/w4a8 with VNNI, vdpbf16ps with AVX512_BF16), 'avx2' (csrc/avx2_linear.c: bf16 and int8
    weights, w8a8/w4a8, same layouts and same sums) or None."""
    return next((isa for isa in _ISA_FLAGS if cpu_runs(isa)), None)


def describe() -> str:
    """Which CPU matmul path bf16 weights take here, for benchmark reports: 'avx512-bf16dot',
    'avx512', 'avx2' (the native kernel's builds) or 'torch' (no native kernel)."""
    isa = native_isa() if native_lib() is not None else None
    if isa is None:
        return "torch"
    return "avx512-bf16dot" if bf16_dot() else isa


def release_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``): loading, joining and
    re-quantising weights leave hundreds of MB freed but still resident. A no-op without glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


_CHOSEN: list = []  # libraries chosen by chosen_library(), innermost last


@contextmanager
def chosen_library(lib):
    """Inside, every native call of every layer goes to ``lib`` (a :func:`load_library` of another build
    of the same ISA, e.g. an older version's, which benchmarks time against this one in one process)."""
    _CHOSEN.append(lib)
    try:
        yield lib
    finally:
        _CHOSEN.pop()


def _unless_chosen(find):
    """A library lookup decided once (``find``, cached), which a chosen library overrides."""
    cached = lru_cache(maxsize=1)(find)

    @wraps(find)
    def lookup():
        return _CHOSEN[-1] if _CHOSEN else cached()
    return lookup


@_unless_chosen
def native_lib():
    """The compiled bf16 kernel (ctypes), or None when it cannot be built or used here."""
    isa = native_isa()
    if os.environ.get("HYDRASPEC_NATIVE", "1") == "0" or isa is None:
        return None
    return build_native(isa)


@lru_cache(maxsize=None)
def build_native(isa: str):
    """Load the kernel for `isa` ('avx512' or 'avx2'): the install-time build when it matches the sources,
    else one compiled on first use (cached on disk; :mod:`hydraspec.cpu.build`), or None.
    An AVX-512 CPU also runs the AVX2 build, which lets tests compare the two."""
    name = library_name(isa)
    if name is None:
        return None
    so = prebuilt_dir() / name
    if not so.exists():
        so, err = compile_library(isa, hydraspec_home() / "kernels")
        if so is None:
            warnings.warn(f"hydraspec: could not compile the {isa} CPU kernel ({err}); using torch's kernels "
                          "(slower verify steps)", stacklevel=2)
            return None
    return load_library(so, isa)


def load_library(so, isa: str):
    """A native build (the .so at ``so``, of ``isa``) loaded, its entry points typed for ctypes."""
    lib = ctypes.CDLL(str(so))
    fn = lib.hs_linear_bf16
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.hs_pack_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.hs_pack_bf16.restype = None
    lib.hs_linear_i8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.hs_linear_i8.restype = ctypes.c_int
    lib.hs_linear_w8a8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.hs_linear_w8a8.restype = ctypes.c_int
    lib.hs_linear_w4a8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.hs_linear_w4a8.restype = ctypes.c_int
    lib.hs_rmsnorm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
                               ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.hs_rmsnorm.restype = ctypes.c_int
    i64p = ctypes.POINTER(ctypes.c_int64)
    lib.hs_attention.argtypes = [ctypes.c_void_p, i64p, ctypes.c_void_p, i64p, ctypes.c_void_p, i64p, ctypes.c_void_p,
                                 i64p, ctypes.c_int, ctypes.c_int] + [ctypes.c_int64] * 7 + \
                                [ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    lib.hs_attention.restype = ctypes.c_int
    lib.hs_rope_bf16.argtypes = [ctypes.c_void_p] * 6 + [i64p]
    lib.hs_rope_bf16.restype = ctypes.c_int
    lib.hs_silu_mul_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int64] * 2 + [ctypes.c_int64] * 2 + \
                                    [ctypes.c_void_p, ctypes.c_int]
    lib.hs_silu_mul_bf16.restype = ctypes.c_int
    if hasattr(lib, "hs_gguf_apply"):  # GGUF weights (cpu.gguf): the weight's fields in one struct
        lib.hs_gguf_apply.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        lib.hs_gguf_apply.restype = ctypes.c_int
        lib.hs_gguf_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        lib.hs_gguf_rows.restype = None
    if hasattr(lib, "hs_prefetch_ahead"):
        lib.hs_prefetch_ahead.argtypes = [ctypes.c_int64]
        lib.hs_prefetch_ahead.restype = None
        set_prefetch(lib)
    if isa != "avx512":
        return lib
    lib.hs_linear_bf16_pairs.argtypes = fn.argtypes
    lib.hs_linear_bf16_pairs.restype = ctypes.c_int
    lib.hs_pack_bf16_pairs.argtypes = lib.hs_pack_bf16.argtypes
    lib.hs_pack_bf16_pairs.restype = None
    if hasattr(lib, "hs_attention_dp"):  # (an older build, loaded to time against, may lack it)
        lib.hs_attention_dp.argtypes = [ctypes.c_int]
        lib.hs_attention_dp.restype = None
        set_attention_dp(lib)
    return lib


def set_attention_dp(lib, on: bool | None = None) -> None:
    """Whether ``lib``'s attention computes bf16 query-key dot products with AVX512_BF16 (hs_ops.h; None: where
    this CPU has it, unless HYDRASPEC_BF16_DOT=0). Off, bf16 attention is the AVX2 build's, bit for bit."""
    if on is None:
        on = bf16_dot_wanted()
    if hasattr(lib, "hs_attention_dp"):
        lib.hs_attention_dp(int(bool(on)))


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512_BF16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


@lru_cache(maxsize=1)
def bf16_dot() -> bool:
    """Whether bf16 weights use the kernel's AVX512_BF16 path (vdpbf16ps: bf16 pairs into fp32, twice the
    arithmetic per instruction of the fp32 path); HYDRASPEC_BF16_DOT=0 keeps the fp32 path."""
    return bf16_dot_wanted() and native_lib() is not None


def bf16_dot_wanted() -> bool:
    """Whether the native kernels should take their AVX512_BF16 paths: this CPU has it and HYDRASPEC_BF16_DOT
    is not 0 (the weights' products, :func:`bf16_dot`, and the attention's, :func:`set_attention_dp`)."""
    return os.environ.get("HYDRASPEC_BF16_DOT", "1") != "0" and "avx512_bf16" in _cpu_flags()


PACK_BLOCK = 32  # outputs per packed block (OB in csrc/bf16_linear.c)


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of a bf16 [out, in] weight: [ceil(out/32), in, 32] bf16, zero padded, or with
    AVX512_BF16 (:func:`bf16_dot`) in input pairs, [ceil(out/32), ceil(in/2), 32, 2]."""
    w = weight.detach().contiguous()
    out, inf = w.shape
    nblk = (out + PACK_BLOCK - 1) // PACK_BLOCK
    if bf16_dot():
        wp = torch.empty(nblk, (inf + 1) // 2, PACK_BLOCK, 2, dtype=torch.bfloat16)
        native_lib().hs_pack_bf16_pairs(w.data_ptr(), out, inf, wp.data_ptr())
    else:
        wp = torch.empty(nblk, inf, PACK_BLOCK, dtype=torch.bfloat16)
        native_lib().hs_pack_bf16(w.data_ptr(), out, inf, wp.data_ptr())
    return wp


def native_linear_bf16(x2: torch.Tensor, weight: torch.Tensor, bias32: torch.Tensor | None,
                       packed: torch.Tensor | None = None) -> torch.Tensor:
    """y = x2 @ weight.T (+ bias) with the native kernel (as PackedLinear runs it); x2 [rows, in] and
    weight [out, in] bf16, bias32 fp32 or None, `packed` = pack_bf16(weight) when the caller keeps one;
    returns bf16 [rows, out] (fp32 accumulation, rounded once)."""
    if packed is None:
        packed = pack_bf16(weight)
    return native_call(_bf16_entry(packed), x2, packed, None, weight.shape[0], bias32)


def _bf16_entry(packed: torch.Tensor):
    """The kernel's entry point for a weight packed by pack_bf16: input pairs (4-D) or plain blocks."""
    lib = native_lib()
    return lib.hs_linear_bf16_pairs if packed.ndim == 4 else lib.hs_linear_bf16


def native_call(fn, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor | None, out: int,
                 bias32: torch.Tensor | None, *extra: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """Run one of the kernel's entry points (hs_linear_bf16 / hs_linear_i8 / hs_linear_w8a8, whose weight sums
    come in `extra` before the scale / hs_linear_w4a8 with `group`) on bf16 rows x [..., in]; returns
    [..., out] bf16. Kept lean: a draft token of a 0.5B model makes ~170 of these calls."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    n = x2.shape[0]
    y = torch.empty(n, out, dtype=torch.bfloat16)
    args = [x2.data_ptr(), n, shape[-1], packed.data_ptr()]
    for t in extra:
        args.append(t.data_ptr())
    if scale is not None:
        args.append(scale.data_ptr())
    if group is not None:
        args.append(group)
    if fn(*args, out, y.data_ptr(), None if bias32 is None else bias32.data_ptr(), torch.get_num_threads()):
        raise MemoryError("hydraspec CPU kernel: out of memory")
    return y.view(*shape[:-1], out)


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_FP32_PLAIN_ROWS: tuple[int, ...] | None = None


def fp32_plain_rows() -> tuple[int, ...]:
    """Row counts (of 1, 2, 3) for which a plain float32 `nn.Linear` beats the prepacked oneDNN weight
    on this CPU, timed once per process on a [2048 x 1024] probe. It differs by machine (docs/cpu-kernels.md,
    "Measurements behind the code"). Override with HYDRASPEC_FP32_PLAIN_ROWS="1,2,3" (or "" for none)."""
    global _FP32_PLAIN_ROWS
    env = os.environ.get("HYDRASPEC_FP32_PLAIN_ROWS")
    if env is not None:
        return tuple(int(r) for r in env.replace(" ", "").split(",") if r)
    if _FP32_PLAIN_ROWS is None:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(2048, 1024, generator=g)
        b = torch.zeros(2048)
        rows = []
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            for n in (1, 2, 3):
                x = torch.randn(n, 1024, generator=g)
                times = {}
                for mode in ("plain", "packed"):
                    call = ((lambda: nn.functional.linear(x, w, b)) if mode == "plain" else
                            (lambda: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")))
                    call()
                    ts = []
                    for _ in range(5):
                        t0 = time.perf_counter()
                        call()
                        ts.append(time.perf_counter() - t0)
                    times[mode] = sorted(ts)[2]
                if times["plain"] < times["packed"]:
                    rows.append(n)
        _FP32_PLAIN_ROWS = tuple(rows)
    return _FP32_PLAIN_ROWS


@lru_cache(maxsize=None)
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack a weight of this dtype here: its bf16 path needs AVX-512 (BW, VL, DQ)
    or AVX-NE-CONVERT and refuses on other CPUs, e.g. AVX2-only ones; those keep the plain kernel."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Module):
    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight = lin.weight  # kept: tied embeddings and shared-lm_head draft heads read it
        self.bias = lin.bias
        self.native = (lin.weight.dtype == torch.bfloat16 and lin.weight.is_contiguous()
                       and native_lib() is not None)
        self.bias32 = lin.bias.detach().float().contiguous() if self.native and lin.bias is not None else None
        self.packed = None
        with torch.no_grad():
            if self.native:  # the kernel's blocked layout (one more bf16 copy of the weight)
                self.packed = pack_bf16(lin.weight)
            elif onednn_packs(lin.weight.dtype):
                self.packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), None)
        # row counts where the plain kernel is faster: bf16 without the native kernel (on an AVX-512 CPU
        # without native bf16); float32 timed on this CPU (fp32_plain_rows)
        self.plain_rows = (2, 3) if lin.weight.dtype == torch.bfloat16 else fp32_plain_rows()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.dtype == torch.bfloat16 and not torch.is_grad_enabled():
            packed = self.packed
            return native_call(_bf16_entry(packed), x, packed, None, self.out_features, self.bias32)
        if torch.is_grad_enabled() or x.dtype != self.weight.dtype:
            return nn.functional.linear(x, self.weight, self.bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] in self.plain_rows or self.packed is None:
            return nn.functional.linear(x, self.weight, self.bias)
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kind = "native bf16 kernel" if self.native else "prepacked" if self.packed is not None else "plain"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


@_unless_chosen
def int8_dot_lib():
    """The native build that runs the int8 x int8 dot products of w8a8 / w4a8 here, or None: the AVX-512
    build where the CPU has AVX512_VNNI, else the AVX2 build (vpmaddubsw; AVX2 CPUs and AVX-512 ones
    without VNNI), with the same integer sums. Decided once, as every w8a8 / w4a8 Linear call asks."""
    if native_lib() is None:
        return None
    if native_isa() == "avx2" or "avx512_vnni" in _cpu_flags():  # the native build (or a chosen one) has them
        return native_lib()
    return build_native("avx2") if cpu_runs("avx2") else None


@_unless_chosen
def fused_lib():
    """The native kernel for the fused small operations (RMSNorm, few-query attention), or None: without
    the kernel, or with HYDRASPEC_FUSED=0 (then torch computes them, as before)."""
    return native_lib() if os.environ.get("HYDRASPEC_FUSED", "1") != "0" else None


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


def unpack(module: nn.Module) -> nn.Module:
    """Turn every PackedLinear inside `module` back into a plain nn.Linear sharing its weight (for copies
    of base layers that are going to be trained: a prepacked copy would go stale)."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                device=child.weight.device, dtype=child.weight.dtype)
                lin.weight = child.weight
                if child.bias is not None:
                    lin.bias = child.bias
                setattr(parent, name, lin)
    return module
