#!/usr/bin/env python3
"""ms per call of hydraspec's GGUF kernel by weight type and number of rows (random codes and scales in the
layouts of Qwen2.5-Coder-1.5B's MLP: Q4_K 1536 -> 8960, Q6_K and Q4_K 8960 -> 1536), median of 40 calls after 5,
and the cost of each row past the first. The weights (7-10 MB) come from L3, so from a few rows on this
measures the arithmetic.

    python benchmarks/kernel_rows.py [--rows 1,2,4,8,16] [--threads 2]
"""
import argparse
import statistics
import time

import numpy as np
import torch

from hydraspec.cpu.gguf import GGUFLinear, QuantWeight

rng = np.random.default_rng(0)


def q4_k(out: int, inp: int) -> QuantWeight:
    g = inp // 32
    return QuantWeight(rng.integers(0, 16, size=(out, inp), dtype=np.uint8), 4, 32, None, None, 0,
                       rng.random((out, g // 8), dtype=np.float32) * 1e-3,
                       rng.integers(0, 64, size=(out, g), dtype=np.int8),
                       rng.random((out, g // 8), dtype=np.float32) * 1e-3,
                       rng.integers(0, 64, size=(out, g), dtype=np.int8))


def q6_k(out: int, inp: int) -> QuantWeight:
    g = inp // 16
    return QuantWeight(rng.integers(0, 64, size=(out, inp), dtype=np.uint8), 6, 16, None, None, 32,
                       rng.random((out, g // 16), dtype=np.float32) * 1e-3,
                       rng.integers(-64, 64, size=(out, g), dtype=np.int8))


def ms_per_call(layer, rows: int) -> float:
    x = torch.randn(rows, layer.in_features).to(torch.bfloat16)
    for _ in range(5):
        layer(x)
    times = []
    for _ in range(40):
        t = time.perf_counter()
        layer(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = [int(r) for r in a.rows.split(",")]
    layers = {"Q4_K 1536 -> 8960": GGUFLinear(q4_k(8960, 1536)), "Q6_K 8960 -> 1536": GGUFLinear(q6_k(1536, 8960)),
              "Q4_K 8960 -> 1536": GGUFLinear(q4_k(1536, 8960))}
    print("| weight | " + " | ".join(f"{r} rows" for r in rows) + " | each row past the first |")
    print("|---|" + "---:|" * (len(rows) + 1))
    with torch.inference_mode():
        for name, layer in layers.items():
            ms = [ms_per_call(layer, r) for r in rows]
            per_row = (ms[-1] - ms[0]) / (rows[-1] - rows[0])
            print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in ms) + f" | {per_row:.3f} |")


if __name__ == "__main__":
    main()
