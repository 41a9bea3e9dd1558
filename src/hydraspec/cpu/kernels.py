"""Faster CPU matmuls for the stock model classes: oneDNN-prepacked Linear weights, and a small
native kernel for bf16 weights on AVX-512 and AVX2 CPUs without native bf16 arithmetic.

A plain `nn.Linear` on CPU repacks its weight into the GEMM kernel's blocked layout on every call;
for the few rows of a decoding step that repacking, not the arithmetic or the weight read, dominates.
`prepack(model)` swaps each Linear leaf module for one that holds its weight prepacked once (the
model classes themselves stay the stock transformers ones). Measured on a 2-core AVX-512 CPU without
native bf16, per [8960 x 1536] weight: fp32 costs about the same for 1..8 rows (memory bound, as
speculative decoding assumes) instead of growing with the rows; bf16 single rows get ~1.6x faster.
Row counts where the plain kernel measured faster keep using it. The results equal plain Linear up to float rounding.

bf16 weights with more rows are the weak spot of oneDNN on CPUs that emulate bf16: its cost grows
with every row (a Qwen2.5-1.5B forward: 256 ms for 1 token, 1185 ms for 8), which defeats
speculative verification. `csrc/bf16_linear.c` packs each bf16 weight once into blocks of 32 outputs
and multiplies it with 12 fp32 activation rows at a time while reading the weight once per call (and
`Int8Linear` does the same with int8 weights for draft models). On CPUs with AVX512_BF16 the bf16
weights are packed in input pairs for vdpbf16ps instead, twice the arithmetic per instruction: a
Qwen2.5-1.5B forward over 16 tokens went from ~330 to ~160 ms on a 2-core AMD EPYC. `pip install` compiles it
with the system C compiler (`prebuilt/`); without that build it is compiled on first use into the hydraspec
home (`kernels/`). It is used when the CPU has AVX-512 (set HYDRASPEC_NATIVE=0 to turn it off). CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2/3, older
Intel) get `csrc/avx2_linear.c` instead: bf16 and int8 weights and the w8a8/w4a8 draft formats, in the
same layouts and with the same sums (there oneDNN refuses to prepack bf16 weights, and torch's plain
bf16 matmul grows with every row: a Qwen2.5-1.5B forward took 213 ms for 1 token and 2446 ms for 16 on
a 2-core Zen 3). The scalar parts of both builds live in `csrc/hs_common.h`. Without a compiler or
either instruction set everything falls back to torch, only slower.
"""
from __future__ import annotations

import ctypes
import os
import warnings
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from ..home import hydraspec_home
from . import ops
from .build import compile_library, library_name, prebuilt_dir



@lru_cache(maxsize=1)
def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


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


@lru_cache(maxsize=1)
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
    if isa != "avx512":
        return lib
    lib.hs_linear_bf16_pairs.argtypes = fn.argtypes
    lib.hs_linear_bf16_pairs.restype = ctypes.c_int
    lib.hs_pack_bf16_pairs.argtypes = lib.hs_pack_bf16.argtypes
    lib.hs_pack_bf16_pairs.restype = None
    return lib


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512_BF16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


@lru_cache(maxsize=1)
def bf16_dot() -> bool:
    """Whether bf16 weights use the kernel's AVX512_BF16 path (vdpbf16ps: bf16 pairs into fp32, twice the
    arithmetic per instruction of the fp32 path); HYDRASPEC_BF16_DOT=0 keeps the fp32 path."""
    return os.environ.get("HYDRASPEC_BF16_DOT", "1") != "0" and native_lib() is not None and \
        "avx512_bf16" in _cpu_flags()


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
    return _native_call(_bf16_entry(packed), x2, packed, None, weight.shape[0], bias32)


def _bf16_entry(packed: torch.Tensor):
    """The kernel's entry point for a weight packed by pack_bf16: input pairs (4-D) or plain blocks."""
    lib = native_lib()
    return lib.hs_linear_bf16_pairs if packed.ndim == 4 else lib.hs_linear_bf16


def _native_call(fn, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor | None, out: int,
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
    on this CPU, measured once per process on a [2048 x 1024] probe (a few ms). It differs by machine:
    on a 2-core Cascade Lake Xeon the plain kernel won for 1-3 rows; on a 2-core Zen 4 EPYC the
    prepacked one is 1.3-10x faster there (a 3-row SmolLM2 lm_head: 37 vs 4 ms). Override with
    HYDRASPEC_FP32_PLAIN_ROWS="1,2,3" (or "" for none)."""
    global _FP32_PLAIN_ROWS
    env = os.environ.get("HYDRASPEC_FP32_PLAIN_ROWS")
    if env is not None:
        return tuple(int(r) for r in env.replace(" ", "").split(",") if r)
    if _FP32_PLAIN_ROWS is None:
        import time

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
        # row counts where the plain kernel is faster: bf16 without the native kernel (measured on a
        # 2-core AVX-512 CPU without native bf16); float32 measured on this CPU (fp32_plain_rows)
        self.plain_rows = (2, 3) if lin.weight.dtype == torch.bfloat16 else fp32_plain_rows()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.dtype == torch.bfloat16 and not torch.is_grad_enabled():
            packed = self.packed
            return _native_call(_bf16_entry(packed), x, packed, None, self.out_features, self.bias32)
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
        lib = native_lib()
        if lib is not None and x.dtype == torch.bfloat16 and x.is_cpu:
            b = self._buffers  # not self.qweight: a buffer lookup through nn.Module.__getattr__ costs ~2 µs
            return _native_call(lib.hs_linear_i8, x, b["qweight"], b["scale"], self.out_features, b["bias32"])
        y = nn.functional.linear(x.float(), self.dequantized(), self.bias32)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


@lru_cache(maxsize=1)
def int8_dot_lib():
    """The native build that runs the int8 x int8 dot products of w8a8 / w4a8 here, or None: the AVX-512
    build where the CPU has AVX512_VNNI, else the AVX2 build (vpmaddubsw; AVX2 CPUs and AVX-512 ones
    without VNNI), with the same integer sums. Decided once, as every w8a8 / w4a8 Linear call asks."""
    if native_lib() is None:
        return None
    if native_isa() == "avx512" and "avx512_vnni" in _cpu_flags():
        return native_lib()
    return build_native("avx2") if cpu_runs("avx2") else None


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
    or AVX2's vpmaddubsw; :func:`int8_dot_lib`): for draft models on CPUs where the int8 kernel is bound by
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
        lib = int8_dot_lib()
        if lib is not None and x.dtype == torch.bfloat16 and x.is_cpu:
            b = self._buffers
            return _native_call(lib.hs_linear_w8a8, x, b["qweight"], b["scale"], self.out_features, b["bias32"],
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
        lib = int8_dot_lib()
        if lib is not None and x.dtype == torch.bfloat16 and x.is_cpu:
            b = self._buffers
            return _native_call(lib.hs_linear_w4a8, x, b["qweight"], b["scale"], self.out_features, b["bias32"],
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

    return _swap_linears(model, make)


def quantize_w8a8(model: nn.Module) -> int:
    """Swap every Linear / PackedLinear inside `model` for a W8A8Linear (draft models only). Returns how many."""
    return _swap_linears(model, W8A8Linear)


def quantize_int8(model: nn.Module) -> int:
    """Swap every Linear / PackedLinear inside `model` for an Int8Linear (draft models only: the target
    must stay unquantised for the output to be the target's). Returns how many."""
    return _swap_linears(model, Int8Linear)


def _swap_linears(model: nn.Module, make) -> int:
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


@lru_cache(maxsize=1)
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
