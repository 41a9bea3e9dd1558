"""llama.cpp's GGUF block formats decoded into integer codes with their scales (:class:`QuantWeight`), as
:mod:`hydraspec.cpu.gguf` holds them: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K. ``scale`` and ``min``
are computed in float32 as gguf-py computes them, so :meth:`QuantWeight.dequantize` equals ``gguf.dequantize``
bit for bit."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf.quants import Q4_K

from ..errors import HydraspecError

__all__ = ["SUPPORTED", "QuantWeight", "decode"]


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
