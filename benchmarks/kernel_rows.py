#!/usr/bin/env python3
"""ms per call of hydraspec's GGUF kernel by weight type and number of rows (random codes and scales in the
layouts of Qwen2.5-Coder-1.5B's MLP: Q4_K 1536 -> 8960, Q6_K and Q4_K 8960 -> 1536), median of 40 calls after 5,
and the cost of each row past the first. The weights (7-10 MB) come from L3, so from a few rows on this
measures the arithmetic. With --from-memory each call goes to the next of 24 copies of the weight (170-240 MB),
so that the weights stream from memory as in a decode step.

    python benchmarks/kernel_rows.py [--rows 1,2,4,8,16] [--threads 2] [--from-memory]
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


def ms_per_call(layers: list, rows: int) -> float:
    """Median ms of one call, the calls going round ``layers`` (copies of one weight)."""
    x = torch.randn(rows, layers[0].in_features).to(torch.bfloat16)
    for layer in layers[:5]:
        layer(x)
    times = []
    for i in range(max(40, 2 * len(layers))):
        t = time.perf_counter()
        layers[i % len(layers)](x)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--from-memory", action="store_true", help="24 copies of each weight, called in turn")
    a = ap.parse_args()
    copies = 24 if a.from_memory else 1
    torch.set_num_threads(a.threads)
    rows = [int(r) for r in a.rows.split(",")]
    makers = {"Q4_K 1536 -> 8960": lambda: q4_k(8960, 1536), "Q6_K 8960 -> 1536": lambda: q6_k(1536, 8960),
              "Q4_K 8960 -> 1536": lambda: q4_k(1536, 8960)}
    print("| weight | " + " | ".join(f"{r} rows" for r in rows) + " | each row past the first |")
    print("|---|" + "---:|" * (len(rows) + 1))
    with torch.inference_mode():
        for name, make in makers.items():
            layers = [GGUFLinear(make()) for _ in range(copies)]
            ms = [ms_per_call(layers, r) for r in rows]
            per_row = (ms[-1] - ms[0]) / (rows[-1] - rows[0])
            print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in ms) + f" | {per_row:.3f} |")


if __name__ == "__main__":
    main()
