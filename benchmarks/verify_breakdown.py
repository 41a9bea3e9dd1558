#!/usr/bin/env python3
"""Where a verify forward's time goes, by module: one forward over n new tokens after a 512-token prefix, at
the GGUF file's precision, eager (not compiled), each module's wall time from forward hooks (the hooks add
about a fifth to the total), mean of 3 forwards after a warm-up. Prints a markdown table, largest last column first.

    python benchmarks/verify_breakdown.py qwen2.5-coder-1.5b-instruct --sizes 1,2,4,8,16
"""
import argparse
import time
from collections import defaultdict

import torch

from hydraspec.cache import new_cache
from hydraspec.models import load_model
from hydraspec.verify import forward_nodes

KINDS = ("GGUFLinear", "Projection")


def label(name: str, module) -> str:
    """The module's name without layer numbers, its class, and for a GGUF weight its bits and shape."""
    short = ".".join(p for p in name.split(".") if not p.isdigit())
    shape = f" {module.bits}-bit {module.in_features}x{module.out_features}" if hasattr(module, "bits") else ""
    return f"{short} ({type(module).__name__}{shape})"


def hook(model, totals: dict) -> None:
    starts = {}
    for name, m in model.named_modules():
        if type(m).__name__ in KINDS or name.endswith(("self_attn", ".mlp", "norm")) or name == "lm_head":
            key = label(name, m)
            m.register_forward_pre_hook(lambda mod, args: starts.__setitem__(id(mod), time.perf_counter()))
            m.register_forward_hook(lambda mod, args, out, key=key:
                                    totals.__setitem__(key, totals[key] + time.perf_counter() - starts.pop(id(mod))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--sizes", default="1,2,4,8,16")
    ap.add_argument("--prefix", type=int, default=512)
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    model, _ = load_model(a.model, progress=False, quant="gguf")
    totals = defaultdict(float)
    hook(model, totals)
    torch.manual_seed(0)
    rows = {}
    with torch.inference_mode():
        cache = new_cache(model, a.prefix + max(sizes) + 4)
        forward_nodes(model, cache, torch.randint(100, 10000, (a.prefix,)), torch.arange(a.prefix), None, 0,
                      last_only=True)
        for n in sizes:
            wall = 0.0
            for rep in range(4):
                if rep == 1:
                    totals.clear()
                t = time.perf_counter()
                forward_nodes(model, cache, torch.randint(100, 10000, (n,)), torch.arange(a.prefix, a.prefix + n),
                              None, a.prefix)
                wall += (time.perf_counter() - t) * (rep > 0)
                cache.crop(a.prefix)
            rows[n] = (wall / 3, {k: v / 3 for k, v in totals.items()})
    print("| module | " + " | ".join(f"n = {n} ms" for n in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    print("| **forward** | " + " | ".join(f"**{rows[n][0] * 1e3:.1f}**" for n in sizes) + " |")
    for key in sorted(rows[sizes[0]][1], key=lambda k: -rows[sizes[-1]][1][k]):
        print(f"| {key} | " + " | ".join(f"{rows[n][1][key] * 1e3:.2f}" for n in sizes) + " |")


if __name__ == "__main__":
    main()
