"""llama.cpp's GGUF block formats decoded into integer codes with their scales (:class:`QuantWeight`), as
:mod:`hydraspec.cpu.gguf` holds them: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and
IQ4_XS (the 2- and 3-bit codes kept in the 4-bit form, the non-linear IQ4 values in the 8-bit one).
``scale`` and ``min`` are computed in float32 as gguf-py computes them, so :meth:`QuantWeight.dequantize`
equals ``gguf.dequantize`` bit for bit."""
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


def _q2_k(b):
    n = b.shape[0]
    sc, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    codes = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    return _two_level(codes.reshape(n, 256), 4, 16, d, (sc & 0x0F).astype(np.int8), dmin,
                      (sc >> 4).astype(np.int8))


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, packed, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = (packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    high = (packed[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 0x03) << 4)).astype(np.int8) - np.int8(32)
    ql = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    qh = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    codes = ql.reshape(n, 256) | (qh.reshape(n, 256) << 2)  # q + 4: the set high bit means no offset
    codes, bits, group, scale, mn, _, levels = _two_level(codes, 4, 16, d, sc)
    return codes, bits, group, scale, mn, 4, levels


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int16)


def _iq4_codes(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes of 4-bit indices -> [n, 32] 8-bit codes: the non-linear values + 128 (Q8_0's form)."""
    return (IQ4_VALUES[_nibbles(qs)] + 128).astype(np.uint8)


def _iq4_nl(b):
    return _iq4_codes(b[:, 2:]), 8, 32, _f16(b[:, :2]), None, 128


def _iq4_xs(b):
    n = b.shape[0]
    d, high, low, qs = _f16(b[:, :2]), b[:, 2:4].copy().view(np.uint16), b[:, 4:8], b[:, 8:136]
    lo = ((low.reshape(n, 4, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)) & 0x0F).reshape(n, 8)
    hi = ((high >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)
    sc = (lo | (hi << 4)).astype(np.int8) - np.int8(32)
    scale = d * sc.astype(np.float32)  # one level: the 8-bit kernel takes an fp32 scale per group
    return _iq4_codes(qs.reshape(n * 8, 16)).reshape(n, 256), 8, 32, scale, None, 128


# type name -> (values per block, bytes per block, decoder of [n_blocks, bytes] -> codes [n, values], ...)
_DECODERS = {
    "Q8_0": (32, 34, _q8_0), "Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1), "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1), "Q4_K": (256, 144, _q4_k), "Q5_K": (256, 176, _q5_k), "Q6_K": (256, 210, _q6_k),
    "Q2_K": (256, 84, _q2_k), "Q3_K": (256, 110, _q3_k), "IQ4_NL": (32, 18, _iq4_nl), "IQ4_XS": (256, 136, _iq4_xs),
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
