"""How far ahead should the 4-bit and GGUF kernels prefetch their weights? Builds the AVX-512 kernel at several
distances (-DPF_AHEAD=bytes; 0 prefetches the line being read, i.e. nothing ahead) into a temporary directory,
and calls each build's GGUF matmul over a model's weights (one row) beside a bare C read loop over the same
buffers, alternating round by round in one process.

    python scripts/prefetch_probe.py qwen2.5-coder-1.5b-instruct [--distances 0,512,1024,2048] [--small]

--small takes the weights of at most 5 M entries (q/k/v/o) instead of the large ones. Needs a C compiler.
"""
import argparse
import ctypes
import subprocess
import tempfile
from pathlib import Path

import torch

from hydraspec.cpu import build
from hydraspec.models import load_model
from read_loop import ReadLoop, alternate, gguf_weights, print_table

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--distances", default="0,512,1024,2048")
ap.add_argument("--rounds", type=int, default=20)
ap.add_argument("--small", action="store_true")
a = ap.parse_args()
torch.set_num_threads(2)
tmp = Path(tempfile.mkdtemp())
libs = {}
for d in (int(x) for x in a.distances.split(",")):
    so = tmp / f"pf{d}.so"
    subprocess.run(["cc", *build.FLAGS["avx512"], "-fopenmp", f"-DPF_AHEAD={d}",
                    str(build.CSRC / build.SOURCES["avx512"]), "-o", str(so)], check=True)
    libs[f"kernel, {d} B ahead"] = ctypes.CDLL(str(so))

model, _ = load_model(a.model, quant="gguf", progress=False)
mods = gguf_weights(model, large=not a.small)
xs = {m.in_features: torch.randn(1, m.in_features, dtype=torch.bfloat16) for m in mods}
ys = [torch.empty(1, m.out_features, dtype=torch.bfloat16) for m in mods]
calls = [(xs[m.in_features].data_ptr(), m.call_struct(), y.data_ptr()) for m, y in zip(mods, ys)]
loop = ReadLoop(mods)


def run(lib):
    f = lib.hs_gguf_apply
    for x, c, y in calls:
        f(ctypes.c_void_p(x), ctypes.c_int64(1), ctypes.c_void_p(c), ctypes.c_void_p(y), 2)


runs = {k: (lambda lib=lib: run(lib)) for k, lib in libs.items()}
runs["C read loop"] = loop
med = alternate(runs, a.rounds)
print(f"{a.model}: {len(mods)} weights, {loop.nbytes / 1e6:.0f} MB, median of {a.rounds} rounds")
print_table(med, loop.nbytes, digits=2)
