"""Are the GGUF matmuls at the memory's speed? The large weights of a model at the file's precision (more
than 5 M weights each: gate/up, down, the output layer) called once each with a one-row input, against a
plain C loop that only reads the same buffers (64-byte loads, 2 OpenMP threads, each buffer split in two
halves as the kernel splits its weight blocks), alternating round by round in one process.

    python scripts/stream_probe.py qwen2.5-coder-1.5b-instruct [--rounds 15]

Needs a C compiler with AVX-512 (the loop is compiled into a temporary directory).
"""
import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from hydraspec.cpu.gguf import GGUFLinear
from hydraspec.models import load_model

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

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--rounds", type=int, default=15)
a = ap.parse_args()
torch.set_num_threads(2)
with tempfile.TemporaryDirectory() as tmp:
    src, so = Path(tmp) / "stream.c", Path(tmp) / "stream.so"
    src.write_text(C_LOOP)
    subprocess.run(["cc", "-O3", "-mavx512f", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
lib.stream.restype = ctypes.c_int64
model, _ = load_model(a.model, quant="gguf", progress=False)
big = [m for n, m in model.named_modules()  # the token table is read one row at a time: left out
       if isinstance(m, GGUFLinear) and not n.endswith("table") and m.out_features * m.in_features > 5e6]
xs = {m.in_features: torch.randn(1, m.in_features, dtype=torch.bfloat16) for m in big}
bufs = [b for m in big for b in m._buffers.values() if b is not None]
ptrs = (ctypes.c_void_p * len(bufs))(*[b.data_ptr() for b in bufs])
sizes = (ctypes.c_int64 * len(bufs))(*[b.numel() * b.element_size() for b in bufs])
nbytes = sum(sizes)


def kernels():
    for m in big:
        m(xs[m.in_features])


runs = {"GGUF kernels": kernels, "C read loop": lambda: lib.stream(ptrs, sizes, len(bufs), 2)}
ms = {k: [] for k in runs}
with torch.inference_mode():
    for r in range(a.rounds + 2):
        for k, f in runs.items():
            t = time.perf_counter()
            f()
            if r >= 2:  # two warm-up rounds
                ms[k].append((time.perf_counter() - t) * 1e3)
print(f"{a.model}: {len(big)} large weights, {nbytes / 1e6:.0f} MB")
print("| | ms (median) | GB/s |\n|---|---:|---:|")
for k, v in ms.items():
    print(f"| {k} | {statistics.median(v):.1f} | {nbytes / statistics.median(v) / 1e6:.1f} |")
print(f"kernels / read loop: {statistics.median(ms['GGUF kernels']) / statistics.median(ms['C read loop']):.3f}")
