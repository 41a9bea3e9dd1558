#!/usr/bin/env python3
"""ms per call of hydraspec's GGUF kernel by weight type and number of rows (random codes and scales in the
layouts of Qwen2.5-Coder-1.5B's MLP: Q4_K 1536 -> 8960, Q6_K and Q4_K 8960 -> 1536), median of 40 calls after 5,
and the cost of each row past the first. The weights (7-10 MB) come from L3, so from a few rows on this
measures the arithmetic. With --from-memory each call goes to the next of 24 copies of the weight (170-240 MB),
so that the weights stream from memory as in a decode step. --lm-head adds the LM head's shape (Q6_K 1536 ->
151,936, 191 MB: from memory at any setting, one copy). --w4a8: the draft models' w4a8 kernel instead, at the
Qwen2.5-Coder-0.5B's shapes (random weights in groups of 64).

    python benchmarks/kernel_rows.py [--rows 1,2,4,8,16] [--threads 2] [--from-memory] [--lm-head] [--w4a8]
                                     [--against REV]

--against REV: REV's kernels (its csrc/ compiled now) timed in the same process, the two alternating call by
call set, with the ratio this / REV per row count; each row's output is checked to be the same bit for bit
(--arithmetic-differs: not, where the two compute differently).
"""
import contextlib
import tempfile
from pathlib import Path

import argparse
import statistics
import time

import numpy as np
import torch

from hydraspec.cpu import kernels
from hydraspec.cpu.gguf import GGUFLinear, QuantWeight
from hydraspec.cpu.quantized import W4A8Linear

rng = np.random.default_rng(0)
LM_HEAD = "Q6_K 1536 -> 151936"  # 191 MB: one copy streams from memory


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


def ms_per_call(layers: list, rows: int, libs: dict | None = None, rounds: int = 1, check: bool = True) -> dict:
    """{library name: median ms of one call}, the calls going round ``layers`` (copies of one weight), the
    libraries (None: this build alone) taking turns in each of ``rounds`` rounds."""
    libs = libs or {"this": None}
    x = torch.randn(rows, layers[0].in_features).to(torch.bfloat16)
    outs = {}
    for name, lib in libs.items():
        with kernels.chosen_library(lib) if lib is not None else contextlib.nullcontext():
            outs[name] = layers[0](x)
            for layer in layers[:5]:
                layer(x)
    first = next(iter(outs.values()))
    assert not check or all(torch.equal(o, first) for o in outs.values()), f"{rows} rows: the builds disagree"
    times = {name: [] for name in libs}
    for _ in range(rounds):
        for name, lib in libs.items():
            with kernels.chosen_library(lib) if lib is not None else contextlib.nullcontext():
                for i in range(max(40, 2 * len(layers)) // rounds + 1):
                    t = time.perf_counter()
                    layers[i % len(layers)](x)
                    times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) * 1e3 for name, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--from-memory", action="store_true", help="24 copies of each weight, called in turn")
    ap.add_argument("--lm-head", action="store_true", help="also the LM head's shape, Q6_K 1536 -> 151,936")
    ap.add_argument("--w4a8", action="store_true", help="the w4a8 draft kernel at the 0.5B's shapes instead")
    ap.add_argument("--against", help="an older revision whose kernels are timed alongside")
    ap.add_argument("--arithmetic-differs", action="store_true", help="do not check that the outputs are equal")
    a = ap.parse_args()
    copies = 24 if a.from_memory else 1
    torch.set_num_threads(a.threads)
    rows = [int(r) for r in a.rows.split(",")]
    libs = {"this": None}
    if a.against:
        from verify_curve import older_kernels  # beside this script
        libs[a.against] = older_kernels(a.against, Path(tempfile.mkdtemp()))
    makers = {"Q4_K 1536 -> 8960": lambda: GGUFLinear(q4_k(8960, 1536)),
              "Q6_K 8960 -> 1536": lambda: GGUFLinear(q6_k(1536, 8960)),
              "Q4_K 8960 -> 1536": lambda: GGUFLinear(q4_k(1536, 8960))}
    if a.lm_head:
        makers[LM_HEAD] = lambda: GGUFLinear(q6_k(151936, 1536))
    if a.w4a8:
        makers = {f"w4a8 {i} -> {o}": (lambda i=i, o=o: W4A8Linear(torch.nn.Linear(i, o), 64))
                  for i, o in ((896, 4864), (4864, 896), (896, 1152))}
    print("| weight | kernels | " + " | ".join(f"{r} rows" for r in rows) + " | each row past the first |")
    print("|---|---|" + "---:|" * (len(rows) + 1))
    rounds = 6 if a.against else 1
    with torch.inference_mode():
        for name, make in makers.items():
            layers = [make() for _ in range(1 if name == LM_HEAD else copies)]
            ms = [ms_per_call(layers, r, libs, rounds=rounds, check=not a.arithmetic_differs) for r in rows]
            for lib in libs:
                v = [m[lib] for m in ms]
                per_row = f"{(v[-1] - v[0]) / (rows[-1] - rows[0]):.3f}" if len(rows) > 1 else ""
                print(f"| {name} | {lib} | " + " | ".join(f"{t:.3f}" for t in v) + f" | {per_row} |")
            if a.against:
                print(f"| {name} | this / {a.against} | "
                      + " | ".join(f"{m['this'] / m[a.against]:.2f}" for m in ms) + " | |")


if __name__ == "__main__":
    main()
