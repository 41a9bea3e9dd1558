"""Time a model's forwards with the fused RMSNorm/attention (csrc/hs_ops.h) and without (torch), alternating
the two in one process so that a machine's drifting speed hits both alike.

    python scripts/fused_ab.py qwen2.5-coder-1.5b-instruct [--quant w4a8] [--n 1] [--rounds 6]

Per round and setting: a 150-token prefill, then 6 forwards over n new tokens (a chain, under a tree
mask when n > 1); prints the medians over rounds, in ms. Used for BENCHMARKS.md "Fused".
"""
import argparse
import statistics
import time

import torch

from hydraspec.cpu import kernels
from hydraspec.cache import new_cache
from hydraspec.models import load_model
from hydraspec.quantize import DRAFT_QUANT, quantize_draft
from hydraspec.verify import forward_nodes

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--quant", choices=DRAFT_QUANT, default="none", help="quantise as a draft model (--draft-quant)")
p.add_argument("--n", type=int, default=1, help="new tokens per timed forward")
p.add_argument("--prefix", type=int, default=150)
p.add_argument("--rounds", type=int, default=6)
a = p.parse_args()
model, _ = load_model(a.model, dtype=a.dtype, progress=False, prepack=a.quant == "none")
quantize_draft(model, a.quant)
if kernels.fused_lib() is None:
    raise SystemExit("no native kernel here (or HYDRASPEC_FUSED=0): nothing to compare")
real = kernels.fused_lib


def one_round():
    torch.manual_seed(0)
    cache = new_cache(model, a.prefix + a.n + 16)
    t = time.perf_counter()
    forward_nodes(model, cache, torch.randint(100, 10000, (a.prefix,)), torch.arange(a.prefix), None, 0, last_only=True)
    prefill = time.perf_counter() - t
    anc = torch.tril(torch.ones(a.n, a.n, dtype=torch.bool)) if a.n > 1 else None
    steps = []
    for _ in range(6):
        L = cache.length
        t = time.perf_counter()
        forward_nodes(model, cache, torch.randint(100, 10000, (a.n,)), L + torch.arange(a.n), anc, L)
        steps.append(time.perf_counter() - t)
        cache.crop(L)
    return prefill, statistics.median(steps)


res = {"fused": [], "torch": []}
with torch.inference_mode():
    for _ in range(a.rounds):
        for name in res:  # the FusedRMSNorm modules and the attention function ask kernels.fused_lib
            kernels.fused_lib = real if name == "fused" else (lambda: None)
            res[name].append(one_round())
kernels.fused_lib = real
for name, rows in res.items():
    print(f"{a.model} {a.dtype} {a.quant} n={a.n} {name}: prefill({a.prefix}) "
          f"{statistics.median(r[0] for r in rows) * 1e3:.0f} ms, step {statistics.median(r[1] for r in rows) * 1e3:.1f} ms")
