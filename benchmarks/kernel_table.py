#!/usr/bin/env python3
"""Time the CPU matmuls a GGUF weight could run on, at 1-32 rows, in one process: hydraspec's GGUF kernel
(the file's Q4_K codes), PyTorch's own int4 CPU matmul (aten._weight_int4pack_mm_for_cpu, asymmetric int4
in groups of 32, bf16 scales and zeros), oneDNN int8 dynamic quantization (torch.ao, per-output int8
weights), hydraspec's w4a8, and bf16 torch.nn.functional.linear. Prints a markdown table of ms per call.
    python benchmarks/kernel_table.py [--out OUT] [--inp 1536] [--outp 8960]"""
import argparse
import time

import numpy as np
import torch

from hydraspec.cpu.gguf import GGUFLinear, QuantWeight
from hydraspec.cpu.quantized import W4A8Linear

ap = argparse.ArgumentParser()
ap.add_argument("--inp", type=int, default=1536)
ap.add_argument("--outp", type=int, default=8960)
ap.add_argument("--rows", default="1,2,4,8,16,32")
ap.add_argument("--reps", type=int, default=30)
a = ap.parse_args()
torch.manual_seed(0)
rng = np.random.default_rng(0)
n, k = a.outp, a.inp
# a Q4_K-shaped weight: 4-bit codes, groups of 32, two-level scales and mins (8 groups per super-block)
codes = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
g = k // 32
qw = QuantWeight(codes, 4, 32, None, None, 0, rng.random((n, g // 8), dtype=np.float32) * 1e-3,
                 rng.integers(0, 64, size=(n, g), dtype=np.int8), rng.random((n, g // 8), dtype=np.float32) * 1e-3,
                 rng.integers(0, 64, size=(n, g), dtype=np.int8))
ours = GGUFLinear(qw, None)
w = ours.dequantized()  # fp32 [n, k]
lin = torch.nn.Linear(k, n, bias=False)
lin.weight.data = w.clone()
lin_bf16 = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
lin_bf16.weight.data = w.to(torch.bfloat16)
w4 = W4A8Linear(lin, 64)

# torch int4: asymmetric, groups of 32: w = (q - 8) * scale + zero, with the file's per-group scale and min
s, mn = ours.group_scales()
q = torch.from_numpy(codes.astype(np.int32))
zero = -mn + 8 * s  # w = s * q - mn = s * (q - 8) + (8 s - mn)
sz = torch.stack([s.T, zero.T], -1).to(torch.bfloat16).contiguous()  # [groups, n, 2]
packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)


def t_int4(x):
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)


torch.backends.quantized.engine = "onednn" if "onednn" in torch.backends.quantized.supported_engines else "fbgemm"
dq = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)


def timeit(f, x):
    for _ in range(5):
        f(x)
    ts = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        f(x)
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2] * 1e3


print(f"weight {n} x {k}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
      f"quantized engine {torch.backends.quantized.engine}")
print("| rows | hydraspec GGUF Q4_K | torch int4pack (g32) | oneDNN int8 dynamic | hydraspec w4a8 (g64) | bf16 linear |")
print("|---:|---:|---:|---:|---:|---:|")
with torch.inference_mode():
    for r in map(int, a.rows.split(",")):
        xb = torch.randn(r, k, dtype=torch.bfloat16)
        xf = xb.float()
        row = [timeit(ours, xb), timeit(t_int4, xb), timeit(dq, xf), timeit(w4, xb), timeit(lin_bf16, xb)]
        print(f"| {r} | " + " | ".join(f"{v:.3f}" for v in row) + " |", flush=True)
    # agreement with the exact weight, one row (the library kernels round scales to bf16)
    x = torch.randn(1, k, dtype=torch.bfloat16)
    ref = x.float() @ w.T
    for name, y in (("gguf", ours(x)), ("int4pack", t_int4(x)), ("onednn", dq(x.float()))):
        print(name, "max rel err", ((y.float() - ref).abs().max() / ref.abs().max()).item())
