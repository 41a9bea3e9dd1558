"""What the memory probes share (stream_probe.py, pages_probe.py, prefetch_probe.py): a bare C loop that only
reads buffers (64-byte loads, 2 OpenMP threads, each buffer split in two halves as the kernels split their
weight blocks), the GGUF weights a probe reads, and timing several runs alternately, round by round, so that a
machine whose memory speed drifts hits them alike. Needs a C compiler with AVX-512."""
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from hydraspec.cpu.gguf import GGUFLinear

C_LOOP = r"""
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>
int64_t stream(const uint8_t** bufs, const int64_t* sizes, int k, int nthreads) {
    int64_t total = 0;
    for (int i = 0; i < k; i++) {
        const uint8_t* b = bufs[i]; int64_t n = sizes[i] / 64, part = 0;
        #pragma omp parallel num_threads(nthreads) reduction(+:part)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            int64_t lo = n * t / nt, hi = n * (t + 1) / nt, j = lo;
            __m512i a = _mm512_setzero_si512(), c = a;
            for (; j + 2 <= hi; j += 2) {
                a = _mm512_xor_si512(a, _mm512_loadu_si512(b + j * 64));
                c = _mm512_xor_si512(c, _mm512_loadu_si512(b + j * 64 + 64));
            }
            for (; j < hi; j++) a = _mm512_xor_si512(a, _mm512_loadu_si512(b + j * 64));
            part += _mm512_reduce_add_epi32(_mm512_xor_si512(a, c));
        }
        total += part;
    }
    return total;
}
"""


def gguf_weights(model, large: bool = True) -> list:
    """The model's GGUF matmuls with more than 5 M weights (gate/up, down, the output layer), or the others
    (``large=False``: q/k/v/o); the token table is read one row at a time and is left out."""
    return [m for n, m in model.named_modules() if isinstance(m, GGUFLinear) and not n.endswith("table")
            and (m.out_features * m.in_features > 5e6) == large]


class ReadLoop:
    """The C loop compiled once, over the buffers of ``mods``: call it to read them all once."""

    def __init__(self, mods):
        with tempfile.TemporaryDirectory() as tmp:
            src, so = Path(tmp) / "stream.c", Path(tmp) / "stream.so"
            src.write_text(C_LOOP)
            subprocess.run(["cc", "-O3", "-mavx512f", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(so)],
                           check=True)
            self.lib = ctypes.CDLL(str(so))
        self.lib.stream.restype = ctypes.c_int64
        bufs = [b for m in mods for b in m._buffers.values() if b is not None]
        self.ptrs = (ctypes.c_void_p * len(bufs))(*[b.data_ptr() for b in bufs])
        self.sizes = (ctypes.c_int64 * len(bufs))(*[b.numel() * b.element_size() for b in bufs])
        self.nbytes = sum(self.sizes)

    def __call__(self):
        return self.lib.stream(self.ptrs, self.sizes, len(self.sizes), 2)


def alternate(runs: dict, rounds: int, warmup: int = 2) -> dict:
    """Each of ``runs`` (name -> callable) once per round, in order, ``warmup`` + ``rounds`` rounds; returns the
    median ms of each over the timed rounds."""
    ms = {k: [] for k in runs}
    with torch.inference_mode():
        for r in range(warmup + rounds):
            for k, f in runs.items():
                t = time.perf_counter()
                f()
                if r >= warmup:
                    ms[k].append((time.perf_counter() - t) * 1e3)
    return {k: statistics.median(v) for k, v in ms.items()}


def print_table(medians: dict, nbytes: int, digits: int = 1) -> None:
    """A markdown table of median ms and the GB/s they make over ``nbytes``."""
    print("| | ms (median) | GB/s |\n|---|---:|---:|")
    for k, v in medians.items():
        print(f"| {k} | {v:.{digits}f} | {nbytes / v / 1e6:.1f} |")
