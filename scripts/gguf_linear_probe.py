"""Time every GGUF weight of a model at the file's precision with a one-row input, grouped by projection and
bit width: ms and MB per token, and the GB/s each kind streams at (the weights are far larger than the
caches, so each call reads from memory). Compare with a plain torch.sum over 1 GiB in the same process.

    python scripts/gguf_linear_probe.py qwen2.5-coder-1.5b-instruct [--passes 10]
"""
import argparse
import collections
import time

import torch

from hydraspec.cpu.gguf import GGUFLinear
from hydraspec.models import load_model

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--passes", type=int, default=10)
args = ap.parse_args()
torch.set_num_threads(2)
model, _ = load_model(args.model, quant="gguf", progress=False, prepack=False)  # prepack=False: not joined
mods = [(n, m) for n, m in model.named_modules() if isinstance(m, GGUFLinear) and not n.endswith("table")]
xs = {m.in_features: torch.randn(1, m.in_features, dtype=torch.bfloat16) for _, m in mods}
secs, size, calls = collections.Counter(), collections.Counter(), collections.Counter()
for rep in range(args.passes + 1):
    for name, m in mods:
        t = time.perf_counter()
        m(xs[m.in_features])
        dt = time.perf_counter() - t
        if rep:  # the first pass warms up
            key = f"{name.split('.')[-1]} ({m.bits}-bit)"
            secs[key] += dt
            size[key] += sum(b.numel() * b.element_size() for b in m._buffers.values() if b is not None)
            calls[key] += 1
n = args.passes
print("| weight | calls per token | ms per token | MB per token | GB/s |\n|---|---:|---:|---:|---:|")
for k in sorted(secs):
    print(f"| {k} | {calls[k] // n} | {secs[k] / n * 1e3:.2f} | {size[k] / n / 1e6:.0f} | {size[k] / secs[k] / 1e9:.1f} |")
print(f"| all | {sum(calls.values()) // n} | {sum(secs.values()) / n * 1e3:.1f} | {sum(size.values()) / n / 1e6:.0f} "
      f"| {sum(size.values()) / sum(secs.values()) / 1e9:.1f} |")
a = torch.ones(1 << 28)
a.sum()  # warm-up
t = time.perf_counter()
a.sum()
print(f"torch.sum over 1 GiB: {a.numel() * 4 / (time.perf_counter() - t) / 1e9:.1f} GB/s")
