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
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hydraspec.errors import HydraspecError
from hydraspec.cpu import ops
from hydraspec.cpu.kernels import release_free_memory

__all__ = ["SUPPORTED", "QuantWeight", "decode", "GGUFLinear", "GGUFEmbedding", "can_concat", "quantize_rows_grouped"]

PACK_BLOCK = 32


@dataclass
class QuantWeight:
    """One GGUF matrix [rows, cols] as codes (uint8, one per weight), ``bits`` kept (4, 6 or 8), group size,
    fp32 ``scale`` [rows, cols/group] and ``min`` (same shape) or integer zero point ``zero``."""

    codes: np.ndarray
    bits: int
    group: int
    scale: np.ndarray
    min: np.ndarray | None
    zero: int
    # K-quants: scale = d * sub_scale, min = dmin * sub_min with one d / dmin per 256 inputs (kept in two levels)
    d: np.ndarray | None = None
    sub_scale: np.ndarray | None = None
    dmin: np.ndarray | None = None
    sub_min: np.ndarray | None = None

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols], as gguf-py computes it."""
        rows, cols = self.codes.shape
        c = self.codes.reshape(rows, -1, self.group)
        s = self.scale[..., None]
        if self.min is None:
            w = s * (c.astype(np.int16) - self.zero).astype(np.float32)
        else:
            w = s * c.astype(np.float32) - self.min[..., None]
        return w.reshape(rows, cols)


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] codes: the low nibbles first, then the high ones (ggml's 32-blocks)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q8_0(b):
    d, qs = _f16(b[:, :2]), b[:, 2:]
    return (qs.view(np.int8).astype(np.int16) + 128).astype(np.uint8), 8, 32, d, None, 128


def _q4_0(b):
    return _nibbles(b[:, 2:]), 4, 32, _f16(b[:, :2]), None, 8


def _q4_1(b):
    return _nibbles(b[:, 4:]), 4, 32, _f16(b[:, :2]), -_f16(b[:, 2:4]), 0


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes (a little-endian uint32) -> [n, 32] fifth bits."""
    return ((qh.copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q5_0(b):
    return _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4), 6, 32, _f16(b[:, :2]), None, 16


def _q5_1(b):
    return _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4), 6, 32, _f16(b[:, :2]), -_f16(b[:, 2:4]), 0


def _k_scales(b):
    """Q4_K / Q5_K super-block header -> d, dmin [n, 1] and the 6-bit sub-scales and sub-mins [n, 8]."""
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(b[:, 4:16].copy())
    return _f16(b[:, :2]), _f16(b[:, 2:4]), sc.astype(np.int8), m.astype(np.int8)


def _two_level(codes, bits, group, d, sc, dmin=None, m=None):
    """A K-quant's decoding: scale = d * sc and min = dmin * m in fp32, as gguf-py computes them."""
    scale = d * sc.astype(np.float32)
    mn = None if dmin is None else dmin * m.astype(np.float32)
    return codes, bits, group, scale, mn, 0 if dmin is not None else 32, (d, sc, dmin, m)


def _q4_k(b):
    n = b.shape[0]
    d, dmin, sc, m = _k_scales(b)
    qs = b[:, 16:144].reshape(n, 4, 32)  # 4 chunks of 64 values: low nibbles, then high nibbles
    codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 256)
    return _two_level(codes, 4, 32, d, sc, dmin, m)


def _q5_k(b):
    n = b.shape[0]
    d, dmin, sc, m = _k_scales(b)
    qh, qs = b[:, 16:48], b[:, 48:176].reshape(n, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    return _two_level((low | (high << 4)).reshape(n, 256), 6, 32, d, sc, dmin, m)


def _q6_k(b):
    n = b.shape[0]
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    codes = low.reshape(n, 2, 4, 32) | (high.reshape(n, 2, 4, 32) << 4)
    return _two_level(codes.reshape(n, 256), 6, 16, d, sc.copy().view(np.int8))


# type name -> (values per block, bytes per block, decoder of [n_blocks, bytes] -> codes [n, values], ...)
_DECODERS = {
    "Q8_0": (32, 34, _q8_0), "Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1), "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1), "Q4_K": (256, 144, _q4_k), "Q5_K": (256, 176, _q5_k), "Q6_K": (256, 210, _q6_k),
}
SUPPORTED = tuple(_DECODERS)


def decode(type_name: str, raw: np.ndarray, rows: int, cols: int) -> QuantWeight:
    """The GGUF tensor bytes ``raw`` (any shape, ``rows * cols`` values of ``type_name``) as a QuantWeight."""
    if type_name not in _DECODERS:
        raise HydraspecError(f"GGUF type {type_name} cannot be held at its own precision "
                             f"(supported: {', '.join(SUPPORTED)}); load the model with --quant none")
    per, nbytes, fn = _DECODERS[type_name]
    if cols % per:
        raise HydraspecError(f"GGUF {type_name} tensor with {cols} columns is not whole blocks of {per}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * cols // per, nbytes)
    codes, bits, group, scale, mn, zero, *levels = fn(blocks)

    def per_row(a, dtype):
        return None if a is None else np.ascontiguousarray(a.reshape(rows, -1), dtype=dtype)
    d, sc, dmin, m = levels[0] if levels else (None,) * 4
    return QuantWeight(np.ascontiguousarray(codes.reshape(rows, cols)), bits, group,
                       per_row(scale, np.float32), per_row(mn, np.float32), zero,
                       per_row(d, np.float32), per_row(sc, np.int8), per_row(dmin, np.float32), per_row(m, np.int8))


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
    from . import kernels

    lib = kernels.int8_dot_lib()
    return lib if lib is not None and hasattr(lib, "hs_gguf_apply") else None


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

    requantizable = True  # a draft model's GGUF weights may be re-quantized (kernels.quantize_w4a8 ...)

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


def _row_order(processor, name: str, rows: int) -> np.ndarray | None:
    """How transformers' tensor processor reorders the rows of GGUF tensor ``name`` (llama's q/k heads are
    stored permuted), as a permutation, or None when it keeps them; anything else it does is refused."""
    probe = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    out = np.asarray(processor.process(weights=probe, name=name).weights).reshape(-1)
    if out.shape == (rows,) and np.array_equal(np.sort(out), probe[:, 0]):
        return None if np.array_equal(out, probe[:, 0]) else out
    raise HydraspecError(f"GGUF tensor {name}: transformers changes its values on loading; "
                         "it cannot be held at the file's precision (load with --quant none)")


class RowReader:
    """Rows [r0, r1) of a tensor in an open file, read when sliced: a large tensor is never held whole."""

    def __init__(self, handle, offset: int, rows: int, row_bytes: int):
        self.handle, self.offset, self.row_bytes = handle, offset, row_bytes
        self.shape = (rows, row_bytes)

    def __getitem__(self, rows: slice) -> np.ndarray:
        r0, r1, _ = rows.indices(self.shape[0])
        self.handle.seek(self.offset + r0 * self.row_bytes)
        data = self.handle.read(max(r1 - r0, 0) * self.row_bytes)
        return np.frombuffer(data, dtype=np.uint8).reshape(-1, self.row_bytes)


def _some_rows(data: RowReader, rows: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """The rows ``rows`` (sorted) of a tensor in a file, read ``chunk`` rows at a time."""
    parts = []
    for r0 in range(0, data.shape[0], chunk):
        sel = rows[(rows >= r0) & (rows < r0 + chunk)]
        if len(sel):
            parts.append(data[r0:r0 + chunk][sel - r0].copy())
    return np.concatenate(parts) if parts else np.zeros((0, data.shape[1]), np.uint8)


def build_model(gguf_file, config, dtype: torch.dtype, attn_implementation: str | None = None,
                progress: bool = True, output_rows: torch.Tensor | None = None):
    """The stock transformers model for ``config`` with the weights of ``gguf_file``: every Linear whose
    tensor is of a :data:`SUPPORTED` type becomes a :class:`GGUFLinear`, a quantized embedding a
    :class:`GGUFEmbedding`; float tensors (norms, biases) are loaded in ``dtype`` (biases fp32 in the
    kernel). The model is built on the meta device first, so no dense copy of the weights is ever made.
    ``output_rows`` (sorted token ids): the output layer covers those ids only (a draft's vocabulary cut,
    :func:`hydraspec.draft_vocab.cut_output`); an output tensor of its own is then read for those rows only."""
    from accelerate import init_empty_weights
    from gguf import GGUFReader, dequantize
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    cut = output_rows
    reader = GGUFReader(str(gguf_file))
    arch = str(reader.fields["general.architecture"].contents())
    reader.fields.clear()  # the metadata (the tokenizer's ~300k strings) costs ~0.4 GB as parsed objects
    kwargs = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    mapping = get_gguf_hf_weights_map(model, processor)
    out_name = next((n for n, m in model.named_modules() if m is model.get_output_embeddings()), None)
    quantized: dict[str, GGUFLinear] = {}  # module name -> its weight at the file's precision
    dense: dict[str, torch.Tensor] = {}  # parameter name -> tensor
    # what each tensor is and where it lies; the reader (and its memory map) goes before any weight is read
    tensors = [(t.name, t.tensor_type, int(t.shape[1]) if len(t.shape) > 1 else 1, int(t.shape[0]), int(t.data_offset),
                int(t.n_bytes), t.data.dtype, t.data.shape) for t in reader.tensors]
    del reader
    # tensors are read with plain file reads: pages of a memory map would count as resident memory
    handle = open(gguf_file, "rb")
    for i, (name, qtype, rows, cols, offset, nbytes, dtype_, shape) in enumerate(
            tqdm(tensors, desc="loading GGUF weights", disable=not progress)):
        if i % 16 == 15:
            release_free_memory()  # the decoding's temporaries, before they add up
        hf = mapping.get(name)
        if hf is None:
            continue
        mod_name, pname = hf.rsplit(".", 1)
        mod = model.get_submodule(mod_name)
        kind = qtype.name
        if pname == "weight" and isinstance(mod, (nn.Linear, nn.Embedding)) and kind not in ("F32", "F16", "BF16"):
            perm = _row_order(processor, name, rows)
            data = RowReader(handle, offset, rows, nbytes // rows)
            if perm is not None:  # rows in another order: read the tensor whole
                data = data[0:rows]
            if output_rows is not None and mod_name == out_name and perm is None:
                data, rows = _some_rows(data, output_rows.numpy()), len(output_rows)
                output_rows = None  # done: the layer holds just these rows
            quantized[mod_name] = GGUFLinear.from_gguf(kind, data, rows, cols, perm)
        else:
            handle.seek(offset)
            data = np.frombuffer(handle.read(nbytes), dtype=np.uint8)
            arr = processor.process(weights=dequantize(data.view(dtype_).reshape(shape), qtype), name=name).weights
            dense[hf] = torch.from_numpy(np.array(arr))
    handle.close()
    for name, mod in list(model.named_modules()):
        if name in quantized:
            table = quantized[name]
            if isinstance(mod, nn.Embedding):
                new = GGUFEmbedding(table, dtype, mod.padding_idx)
            else:
                bias = dense.pop(f"{name}.bias", None)
                table.bias32 = None if bias is None else bias.float().contiguous()
                new = table
            model.set_submodule(name, new)
    in_name = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    if out_name and out_name not in quantized and f"{out_name}.weight" not in dense and in_name in quantized:
        model.set_submodule(out_name, quantized[in_name])  # tied embeddings: one copy, read both ways
    for hf, tensor in dense.items():
        mod_name, pname = hf.rsplit(".", 1)
        mod = model.get_submodule(mod_name)
        keep = torch.float32 if isinstance(mod, GGUFLinear) else dtype
        setattr(mod, pname, nn.Parameter(tensor.to(keep), requires_grad=False))
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise HydraspecError(f"GGUF file {gguf_file} has no tensor for {', '.join(missing[:5])}")
    if cut is not None:
        from ..draft_vocab import DraftVocabHead, cut_output

        if output_rows is None:  # read for those rows only
            vocab = config.get_text_config(decoder=True).vocab_size
            model.set_submodule(out_name, DraftVocabHead(quantized[out_name], cut, vocab))
        else:  # tied to the embeddings, or a float tensor: cut from the whole
            cut_output(model, cut)
    return model.eval()
