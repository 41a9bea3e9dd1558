#!/usr/bin/env python3
"""The native few-query attention kernel alone (csrc/hs_ops.h's hs_attention) in Qwen2.5-Coder-1.5B's shape
(12 query heads on 2 kv heads of 128, bf16): n new tokens against a cache of --prefix tokens plus themselves,
a causal bool mask, microseconds per call (the least of --rounds medians of 100 calls). With --against REV
that revision's build is timed in the same process, round by round in turn, and the outputs compared.

    python benchmarks/attention_kernel.py [--against 8b39aae] [--prefix 512] [--sizes 1,2,4,8,16]
"""
import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from verify_curve import older_kernels

from hydraspec.cpu import kernels
from hydraspec.cpu.attention import cpu_attention


def us_per_call(args, calls: int = 100) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        cpu_attention(None, *args, scaling=128 ** -0.5)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,2,4,8,16")
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    libs = {"this": kernels.native_lib()}
    tmp = Path(tempfile.mkdtemp())
    try:
        if a.against:
            libs[a.against] = older_kernels(a.against, tmp)
        print("| n | " + " | ".join(f"{k} us" for k in libs) + " | same output |")
        print("|---:|" + "---:|" * len(libs) + "---|")
        for n in (int(s) for s in a.sizes.split(",")):
            g = torch.Generator().manual_seed(n)
            L = a.prefix + n
            q = torch.randn(1, 12, n, 128, generator=g).bfloat16()
            k, v = (torch.randn(1, 2, L, 128, generator=g).bfloat16() for _ in range(2))
            mask = torch.ones(n, L, dtype=torch.bool).tril(a.prefix)[None, None]
            best, outs = {}, {}
            with torch.inference_mode():
                for _ in range(a.rounds):
                    for name, lib in libs.items():
                        with kernels.chosen_library(lib):
                            outs[name] = cpu_attention(None, q, k, v, mask, scaling=128 ** -0.5)[0]
                            best[name] = min(best.get(name, float("inf")), us_per_call((q, k, v, mask)))
            same = all(torch.equal(o, outs["this"]) for o in outs.values())
            print(f"| {n} | " + " | ".join(f"{best[k]:.0f}" for k in libs) + f" | {'bit for bit' if same else 'NO'} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
