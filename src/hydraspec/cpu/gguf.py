"""GGUF weights at the file's own precision: decoding llama.cpp's block formats into integer codes with
their scales, and the Linear / Embedding modules that compute with them.

Every supported type is one of two forms over groups of G inputs of one output row:

* zero point: ``w = scale * (code - z)``: Q8_0 (z 128), Q6_K (G 16, z 32), Q5_0 (z 16), Q4_0 (z 8);
* min:        ``w = scale * code - min``: Q4_K, Q5_K, Q4_1, Q5_1 (``min`` is minus the file's offset).

``scale`` and ``min`` are the file's fp16 block scales times its 6-/8-bit sub-block scales, computed in
float32 as gguf-py computes them, so :meth:`QuantWeight.dequantize` equals ``gguf.dequantize`` bit for bit.
Codes are kept at 4 bits (two a byte: Q4_K, Q4_1, Q4_0), 6 bits (four bits two a byte plus the top two
four a byte: Q6_K and the 5-bit types) or 8 bits (Q8_0).

:class:`GGUFLinear` multiplies with the native kernel (``hs_gguf_apply``: int8 activations per row and group
of G, as llama.cpp quantises them per block, exact integer sums per group). Without it, the same
arithmetic runs in torch: integer sums in float32 (exact: a group's sum stays below 2^24), groups added in
order. Either way a row's output depends on that row alone, so a verify step over many tokens computes
what plain decoding computes.
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch
from torch import nn

from . import kernels, ops
from ..errors import HydraspecError
from .gguf_blocks import SUPPORTED, QuantWeight, decode

__all__ = ["SUPPORTED", "QuantWeight", "decode", "GGUFLinear", "GGUFEmbedding", "can_concat", "quantize_rows_grouped",
           "rows_per_pass"]

PACK_BLOCK = 32


def quantize_rows_grouped(x2: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x2 [rows, in] in groups of ``group`` inputs as integers in [-127, 127] (fp32) and the
    group's fp32 scale (absmax/127, 1 for an all-zero group), rounded half to even: [rows, in/group, group]
    and [rows, in/group]. The native kernel's activation arithmetic."""
    xf = x2.float().view(x2.shape[0], -1, group)
    amax = xf.abs().amax(-1)
    s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(xf / s[..., None]).clamp_(-127, 127), s


def _pack_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, k] -> [ceil(rows/32), k, 32] zero padded (the kernel's per-block layout of scales)."""
    pad = (-rows) % PACK_BLOCK
    if pad:
        t = torch.cat([t, t.new_zeros(pad, t.shape[1])])
    return t.view(-1, PACK_BLOCK, t.shape[1]).transpose(1, 2).contiguous()


def can_concat(parts: list["GGUFLinear"]) -> bool:
    """Whether :meth:`GGUFLinear.concat` can join ``parts``: one format (bits, groups, zero point, scale
    levels), one input size, and every part but the last a whole number of 32-row blocks."""
    if len(parts) < 2 or not all(isinstance(p, GGUFLinear) for p in parts):
        return False

    def form(p):
        return (p.in_features, p.bits, p.group, p.zero, p.per_d,
                tuple(n for n, t in p._buffers.items() if t is None and n != "bias32"))
    return len({form(p) for p in parts}) == 1 and all(p.out_features % PACK_BLOCK == 0 for p in parts[:-1])


def _gguf_lib():
    lib = kernels.int8_dot_lib()
    return lib if lib is not None and hasattr(lib, "hs_gguf_apply") else None


def rows_per_pass() -> int | None:
    """The most activation rows the GGUF kernel takes per pass over a block of weights (NBG in
    csrc/bf16_linear.c, the AVX-512 VNNI build, fewer over wide weights: hs_gguf.h's pass_rows; NG in
    csrc/avx2_linear.c); None without the kernel."""
    lib = _gguf_lib()
    if lib is None:
        return None
    return 4 if "avx2_linear" in str(getattr(lib, "_name", "")) else 12


class _GGUFCall(ctypes.Structure):
    """hs_gguf.h's gguf_call: a GGUF weight's shape, format and buffers (y is set by the kernel per call)."""
    _fields_ = [(n, ctypes.c_int64) for n in ("in_", "out", "G", "bits", "zero", "per_d")] + \
               [(n, ctypes.c_void_p) for n in ("wq", "wh", "sc", "mn", "d", "ssc", "dmin", "smn", "y", "bias")]


class GGUFLinear(nn.Module):
    """A Linear layer whose weight is a GGUF tensor at the file's own precision (see the module docstring);
    ``bias`` (fp32) is added to the fp32 sums before the output is rounded to the activations' dtype.
    K-quants keep their two levels of scales (an fp32 ``d`` per 256 inputs, an int8 sub-scale per group),
    the kernel multiplying them out as gguf-py does: 0.59 bytes a Q4_K weight instead of 0.75."""

    def __init__(self, qw: QuantWeight, bias: torch.Tensor | None = None):
        super().__init__()
        out, inf = qw.codes.shape
        self._allocate(out, inf, qw, bias)
        self._fill(0, qw)

    def _allocate(self, out: int, inf: int, qw: QuantWeight, bias: torch.Tensor | None) -> None:
        self.in_features, self.out_features = inf, out
        self.bits, self.group, self.zero = qw.bits, qw.group, qw.zero
        if inf % 4 or self.group % 4 or inf % self.group:
            raise HydraspecError(f"GGUF weight [{out} x {inf}] with groups of {self.group} does not fit the kernel")
        nblk, ng = (out + PACK_BLOCK - 1) // PACK_BLOCK, inf // self.group
        width = PACK_BLOCK if self.bits == 8 else PACK_BLOCK // 2
        two = qw.d is not None
        self.per_d = ng // qw.d.shape[1] if two else 0  # groups per super-block scale
        nsb = qw.d.shape[1] if two else 0

        def buf(name, present, k, dtype):
            self.register_buffer(name, torch.zeros(nblk, k, PACK_BLOCK, dtype=dtype) if present else None)
        self.register_buffer("qweight", torch.zeros(nblk, inf // 4, width, 4, dtype=torch.uint8))
        self.register_buffer("qhigh", torch.zeros(nblk, inf // 4, PACK_BLOCK, dtype=torch.uint8)
                             if self.bits == 6 else None)
        buf("scale", not two, ng, torch.float32)
        buf("minimum", not two and qw.min is not None, ng, torch.float32)
        buf("d", two, nsb, torch.float32)
        buf("sub_scale", two, ng, torch.int8)
        buf("dmin", two and qw.dmin is not None, nsb, torch.float32)
        buf("sub_min", two and qw.dmin is not None, ng, torch.int8)
        self.register_buffer("bias32", None if bias is None else bias.detach().float().contiguous())

    def _fill(self, row0: int, qw: QuantWeight) -> None:
        """Write the rows row0 .. row0+len (row0 a multiple of 32) of the packed buffers from ``qw``."""
        n, inf = qw.codes.shape
        b0, pad = row0 // PACK_BLOCK, (-n) % PACK_BLOCK
        codes = torch.from_numpy(qw.codes)
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad, inf)])
        cb = codes.view(-1, PACK_BLOCK, inf // 4, 4).permute(0, 2, 1, 3)  # [blocks, in/4, 32, 4]
        nb = cb.shape[0]
        if self.bits == 6:  # the top two bits: see hs_gguf.h
            top = (cb >> 4).reshape(nb, inf // 4, 2, 64)
            self.qhigh[b0:b0 + nb] = top[:, :, 0, :32] | (top[:, :, 0, 32:] << 2) | (top[:, :, 1, :32] << 4) | \
                (top[:, :, 1, 32:] << 6)
            cb = cb & 15
        if self.bits != 8:
            cb = cb[:, :, :16] | (cb[:, :, 16:] << 4)
        self.qweight[b0:b0 + nb] = cb
        sources = {"scale": qw.scale, "minimum": qw.min, "d": qw.d, "sub_scale": qw.sub_scale, "dmin": qw.dmin,
                   "sub_min": qw.sub_min}
        for name, arr in sources.items():
            if self._buffers.get(name) is not None:
                self._buffers[name][b0:b0 + nb] = _pack_rows(torch.from_numpy(arr), n)

    @classmethod
    def from_gguf(cls, type_name: str, raw: np.ndarray, rows: int, cols: int, perm: np.ndarray | None = None,
                  bias: torch.Tensor | None = None, chunk: int = 4096) -> "GGUFLinear":
        """Build from a GGUF tensor's bytes ``raw`` ([rows, bytes per row]: an array, or a :class:`RowReader`
        that reads rows from the file as they are sliced), decoding ``chunk`` rows at a time (so loading never
        holds a second copy of a large tensor); ``perm`` reorders the rows."""
        if isinstance(raw, np.ndarray):
            raw = raw.reshape(rows, -1)
        first = decode(type_name, np.asarray(raw[:1] if perm is None else raw[perm[:1]]), 1, cols)
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._allocate(rows, cols, first, bias)
        for r0 in range(0, rows, chunk):
            part = raw[r0:r0 + chunk] if perm is None else raw[perm[r0:r0 + chunk]]
            self._fill(r0, decode(type_name, np.asarray(part), part.shape[0], cols))
        return self

    # -- the weight as the file holds it -----------------------------------------------------------------
    def _rows(self, rows: torch.Tensor | None):
        if rows is None:
            rows = torch.arange(self.out_features)
        return rows, rows // PACK_BLOCK, rows % PACK_BLOCK

    def _level(self, name: str, blk: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
        t = self._buffers.get(name)
        return None if t is None else t[blk, :, k]

    def codes(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The codes (uint8) of output rows ``rows`` (default all) as [len(rows), in]."""
        rows, blk, k = self._rows(rows)
        if self.bits != 8:
            byte = self.qweight[blk, :, k % 16]  # [n, in/4, 4]
            c = torch.where((k >= 16)[:, None, None], byte >> 4, byte & 15)
            if self.bits == 6:
                lane = 4 * (k % 16)[:, None] + torch.arange(4)  # [n, 4]
                shift = 4 * (k >= 16)[:, None].to(torch.uint8) + 2 * (lane >= 32).to(torch.uint8)
                top = self.qhigh[blk[:, None], :, lane % 32].permute(0, 2, 1)  # [n, in/4, 4]
                c = c | (((top >> shift[:, None, :]) & 3) << 4)
        else:
            c = self.qweight[blk, :, k]
        return c.reshape(len(rows), self.in_features)

    def group_scales(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 (scale, min or None), each [len(rows), in/group]: K-quants' two levels multiplied out in fp32."""
        rows, blk, k = self._rows(rows)
        if self.d is None:
            return self._level("scale", blk, k), self._level("minimum", blk, k)
        d = self._level("d", blk, k).repeat_interleave(self.per_d, 1)
        scale = d * self._level("sub_scale", blk, k).float()
        if self.dmin is None:
            return scale, None
        return scale, self._level("dmin", blk, k).repeat_interleave(self.per_d, 1) * \
            self._level("sub_min", blk, k).float()

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 weight rows (default all) [n, in]: equal to gguf's own dequantization."""
        rows, _, _ = self._rows(rows)
        n, g = len(rows), self.in_features // self.group
        c = self.codes(rows).view(n, g, self.group)
        s, mn = self.group_scales(rows)
        if mn is None:
            w = s[..., None] * (c.to(torch.int16) - self.zero).float()
        else:
            w = s[..., None] * c.float() - mn[..., None]
        return w.view(n, self.in_features)

    def select(self, rows: torch.Tensor) -> "GGUFLinear":
        """A GGUFLinear over output rows ``rows`` of this one (same codes and scales)."""
        rows, blk, k = self._rows(rows)

        def lv(name):
            t = self._level(name, blk, k)
            return None if t is None else t.numpy()
        qw = QuantWeight(self.codes(rows).numpy(), self.bits, self.group, lv("scale"), lv("minimum"), self.zero,
                         lv("d"), lv("sub_scale"), lv("dmin"), lv("sub_min"))
        return GGUFLinear(qw, None if self.bias32 is None else self.bias32[rows])

    requantizable = True  # a draft model's GGUF weights may be re-quantized (quantized.quantize_w4a8 ...)

    @property
    def weight(self) -> torch.Tensor:
        """The whole weight dequantized to bf16 (a copy: for code that reads ``.weight`` rarely)."""
        return self.dequantized().to(torch.bfloat16)

    @property
    def bias(self) -> torch.Tensor | None:
        return self.bias32

    # -- the product ------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.tracing() and x.dtype == torch.bfloat16:
            return torch.ops.hydraspec.gguf_linear(x, self._call_tensor, self.out_features)
        lib = _gguf_lib()
        if lib is not None and x.dtype == torch.bfloat16 and x.is_cpu:
            if not x.is_contiguous():
                x = x.contiguous()
            y = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.bfloat16)
            if lib.hs_gguf_apply(x.data_ptr(), x.numel() // self.in_features, self.call_struct(), y.data_ptr(),
                                 torch.get_num_threads()):
                raise MemoryError("hydraspec CPU kernel: out of memory")
            return y
        return self.reference(x)

    def call_struct(self) -> int:
        """The address of this weight's fields as the native kernel reads them (hs_gguf.h's gguf_call), built
        once and rebuilt whenever the buffers have moved."""
        b = self._buffers
        key = (b["qweight"].data_ptr(), None if b["bias32"] is None else b["bias32"].data_ptr())  # moved or re-biased
        if getattr(self, "_call_key", None) != key:
            ptr = {n: (None if t is None else t.data_ptr()) for n, t in b.items()}
            self._call = _GGUFCall(self.in_features, self.out_features, self.group, self.bits, self.zero, self.per_d,
                                   ptr["qweight"], ptr["qhigh"], ptr["scale"], ptr["minimum"], ptr["d"],
                                   ptr["sub_scale"], ptr["dmin"], ptr["sub_min"], None, ptr["bias32"])
            self._call_key, self._call_addr = key, ctypes.addressof(self._call)
        return self._call_addr

    def call_tensor(self) -> torch.Tensor:
        """The fields of :meth:`call_struct` as an int64 tensor, as the compiled steps' operator takes them
        (hydraspec.cpu.graph); kept as ``_call_tensor``."""
        addr = self.call_struct()
        if getattr(self, "_call_tensor_key", None) != self._call_key:  # built with the struct's current buffers
            raw = ctypes.string_at(addr, ctypes.sizeof(_GGUFCall))
            object.__setattr__(self, "_call_tensor", torch.frombuffer(bytearray(raw), dtype=torch.int64).clone())
            object.__setattr__(self, "_call_tensor_key", self._call_key)
        return self._call_tensor

    @classmethod
    def concat(cls, parts: list["GGUFLinear"]) -> "GGUFLinear":
        """One GGUFLinear whose outputs are those of ``parts`` one after another (same input, same format,
        every part but the last a whole number of 32-row blocks: see :func:`can_concat`). Each output is
        computed exactly as its part computes it."""
        if not can_concat(parts):
            raise HydraspecError("these GGUF weights differ in format or block alignment and cannot be joined")
        first = parts[0]
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features = first.in_features, sum(p.out_features for p in parts)
        self.bits, self.group, self.zero, self.per_d = first.bits, first.group, first.zero, first.per_d
        for name, t in first._buffers.items():
            if name == "bias32":
                continue
            self.register_buffer(name, None if t is None else torch.cat([p._buffers[name] for p in parts]))
        biases = [p.bias32 for p in parts]
        self.register_buffer("bias32", None if all(b is None for b in biases) else torch.cat(
            [torch.zeros(p.out_features) if b is None else b for p, b in zip(parts, biases)]))
        return self

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel's arithmetic in torch: exact integer group sums (fp32 holds them exactly), scaled and
        added group by group in order."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        q, sx = quantize_rows_grouped(x2, self.group)  # [n, G, g], [n, G]
        n, ng = q.shape[0], q.shape[1]
        xs = q.sum(-1)  # [n, G]
        y = torch.zeros(n, self.out_features)
        chunk = max(1, (1 << 22) // self.in_features)
        for o in range(0, self.out_features, chunk):
            rows = torch.arange(o, min(o + chunk, self.out_features))
            c = self.codes(rows).float().view(len(rows), ng, self.group).permute(1, 2, 0)  # [G, g, rows]
            isum = torch.bmm(q.permute(1, 0, 2), c)  # [G, n, rows] exact integers
            sw, mn = (None if t is None else t.T for t in self.group_scales(rows))  # [G, rows]
            acc = torch.zeros(n, len(rows))
            for g in range(ng):
                if mn is None:
                    acc = acc + (isum[g] - self.zero * xs[:, g:g + 1]) * sw[g] * sx[:, g:g + 1]
                else:
                    acc = acc + isum[g] * sw[g] * sx[:, g:g + 1] - mn[g] * (sx[:, g:g + 1] * xs[:, g:g + 1])
            y[:, o:o + len(rows)] = acc
        if self.bias32 is not None:
            y = y + self.bias32
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        form = "min" if (self.minimum is not None or self.dmin is not None) else f"zero point {self.zero}"
        levels = ", two-level scales" if self.d is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.bits}-bit codes, "
                f"groups of {self.group}, {form}{levels}")


class GGUFEmbedding(nn.Module):
    """Token embeddings read from a GGUFLinear's rows (tied embeddings share one copy), dequantized per
    looked-up token and rounded to ``dtype``."""

    def __init__(self, table: GGUFLinear, dtype: torch.dtype, padding_idx: int | None = None):
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.padding_idx = padding_idx
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    @property
    def weight(self) -> torch.Tensor:
        """The whole table dequantized (a copy)."""
        return self.table.dequantized().to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ops.tracing() and self.dtype == torch.bfloat16:
            return torch.ops.hydraspec.gguf_rows(ids, self.table._call_tensor, self.embedding_dim)
        flat = ids.reshape(-1)
        lib = _gguf_lib()
        if lib is not None and self.dtype == torch.bfloat16 and flat.is_cpu:
            flat = flat.to(torch.int64).contiguous()
            if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < self.num_embeddings:
                raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
            out = torch.empty(flat.numel(), self.embedding_dim, dtype=torch.bfloat16)
            lib.hs_gguf_rows(self.table.call_struct(), flat.data_ptr(), flat.numel(), out.data_ptr())
            return out.view(*ids.shape, self.embedding_dim)
        return self.table.dequantized(flat).to(self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, GGUF rows"
