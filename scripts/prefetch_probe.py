"""How far ahead should the 4-bit and GGUF kernels prefetch their weights? Builds the AVX-512 kernel at several
distances (-DPF_AHEAD=bytes; 0 prefetches the line being read, i.e. nothing ahead) into a temporary directory,
and calls each build's GGUF matmul over a model's weights (one row) beside a bare C read loop over the same
buffers, alternating round by round in one process.

    python scripts/prefetch_probe.py qwen2.5-coder-1.5b-instruct [--distances 0,512,1024,2048] [--small]

--small takes the weights of at most 5 M entries (q/k/v/o) instead of the large ones. Needs a C compiler.
"""
import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from hydraspec.cpu import build
from hydraspec.cpu.gguf import GGUFLinear
from hydraspec.models import load_model

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--distances", default="0,512,1024,2048")
ap.add_argument("--rounds", type=int, default=20)
ap.add_argument("--small", action="store_true")
a = ap.parse_args()
torch.set_num_threads(2)
tmp = Path(tempfile.mkdtemp())
loop_src = (Path(__file__).parent / "stream_probe.py").read_text().split('C_LOOP = r"""')[1].split('"""')[0]
(tmp / "s.c").write_text(loop_src)
subprocess.run(["cc", "-O3", "-mavx512f", "-fopenmp", "-shared", "-fPIC", str(tmp / "s.c"), "-o", str(tmp / "s.so")],
               check=True)
loop = ctypes.CDLL(str(tmp / "s.so"))
loop.stream.restype = ctypes.c_int64
libs = {}
for d in (int(x) for x in a.distances.split(",")):
    so = tmp / f"pf{d}.so"
    subprocess.run(["cc", *build.FLAGS["avx512"], "-fopenmp", f"-DPF_AHEAD={d}",
                    str(build.CSRC / build.SOURCES["avx512"]), "-o", str(so)], check=True)
    libs[f"kernel, {d} B ahead"] = ctypes.CDLL(str(so))

model, _ = load_model(a.model, quant="gguf", progress=False)
mods = [m for n, m in model.named_modules() if isinstance(m, GGUFLinear) and not n.endswith("table")
        and (m.out_features * m.in_features > 5e6) != a.small]
xs = {m.in_features: torch.randn(1, m.in_features, dtype=torch.bfloat16) for m in mods}
ys = [torch.empty(1, m.out_features, dtype=torch.bfloat16) for m in mods]
calls = [(xs[m.in_features].data_ptr(), m.call_struct(), y.data_ptr()) for m, y in zip(mods, ys)]
bufs = [b for m in mods for b in m._buffers.values() if b is not None]
ptrs = (ctypes.c_void_p * len(bufs))(*[b.data_ptr() for b in bufs])
sizes = (ctypes.c_int64 * len(bufs))(*[b.numel() * b.element_size() for b in bufs])
nbytes = sum(sizes)


def run(lib):
    f = lib.hs_gguf_apply
    for x, c, y in calls:
        f(ctypes.c_void_p(x), ctypes.c_int64(1), ctypes.c_void_p(c), ctypes.c_void_p(y), 2)


runs = {k: (lambda lib=lib: run(lib)) for k, lib in libs.items()}
runs["C read loop"] = lambda: loop.stream(ptrs, sizes, len(bufs), 2)
ms = {k: [] for k in runs}
for r in range(a.rounds + 2):
    for k, f in runs.items():
        t = time.perf_counter()
        f()
        if r >= 2:
            ms[k].append((time.perf_counter() - t) * 1e3)
print(f"{a.model}: {len(mods)} weights, {nbytes / 1e6:.0f} MB, median of {a.rounds} rounds")
print("| | ms | GB/s |\n|---|---:|---:|")
for k, v in ms.items():
    print(f"| {k} | {statistics.median(v):.2f} | {nbytes / statistics.median(v) / 1e6:.1f} |")
