"""Time one forward of a model over n new tokens after a 100-token prefix (the cost of a verify step).

    python benchmarks/verify_cost.py qwen2.5-coder-1.5b-instruct --dtype bfloat16 [--no-prepack] [--quant int8|w8a8|w4a8]
    python benchmarks/verify_cost.py qwen2.5-coder-1.5b-instruct --gguf      # at the GGUF file's own precision

Prints the best of 3 runs per n, in ms. Used for the verify-cost tables in docs/cpu-kernels.md.
"""
import argparse
import time

import torch
from transformers import DynamicCache

from hydraspec.models import load_model
from hydraspec.quantize import DRAFT_QUANT, quantize_draft

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--no-prepack", action="store_true")
p.add_argument("--sizes", default="1,2,4,8,16,32")
p.add_argument("--quant", choices=DRAFT_QUANT, default="none", help="quantise as a draft model (--draft-quant)")
p.add_argument("--gguf", action="store_true", help="keep the GGUF file's own precision (--quant gguf of the CLI)")
a = p.parse_args()
model, _ = load_model(a.model, dtype=a.dtype, progress=False, prepack=not a.no_prepack,
                      quant="gguf" if a.gguf else "none")
quantize_draft(model, a.quant)
torch.manual_seed(0)
prefix = torch.randint(100, 10000, (1, 100))
with torch.inference_mode():
    row = []
    for n in [int(x) for x in a.sizes.split(",")]:
        best = float("inf")
        for _ in range(3):
            cache = DynamicCache(config=model.config)
            model(prefix, past_key_values=cache, use_cache=True)
            x = torch.randint(100, 10000, (1, n))
            t = time.perf_counter()
            model(x, past_key_values=cache, use_cache=True)
            best = min(best, time.perf_counter() - t)
        row.append(f"{n}: {best * 1e3:.0f}")
    print(f"{a.model} {a.dtype} {'plain' if a.no_prepack else 'hydraspec kernels'} {'gguf ' if a.gguf else ''}{a.quant} (ms per forward) -> " + ", ".join(row))
