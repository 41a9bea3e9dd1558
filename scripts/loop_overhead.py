"""ms per target forward at batch 1: an older generator.py (its own decoding loop) against today's, in one
process, alternating per prompt; also checks that both give the same tokens.

    git show a15e5fa:src/hydraspec/generator.py | sed 's/^from \\.\\([a-z_.]*\\) import/from hydraspec.\\1 import/' > /tmp/oldgen.py
    python scripts/loop_overhead.py /tmp/oldgen.py smollm2-135m-instruct none pld [repeats]
"""
import importlib.util
import statistics
import sys

import torch

from hydraspec import make_drafter
from hydraspec.generator import SpeculativeGenerator
from hydraspec.models import load_model

old_path, name, quant, method = sys.argv[1:5]
repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 4
spec = importlib.util.spec_from_file_location("oldgen", old_path)
oldgen = importlib.util.module_from_spec(spec)
sys.modules["oldgen"] = oldgen  # dataclasses look their module up
spec.loader.exec_module(oldgen)
torch.set_num_threads(2)
model, tok = load_model(name, quant=quant, progress=False)


def drafter():
    return make_drafter(method) if method != "ar" else None


gens = {"old loop": oldgen.SpeculativeGenerator(model, tok, drafter()),
        "one-row engine": SpeculativeGenerator(model, tok, drafter())}
prompts = ["Write a Python function that checks whether a number is prime.", "Explain what a hash map is, briefly.",
           "def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
ms = {k: [] for k in gens}
same = True
for g in gens.values():
    g.generate(prompts[0], max_new_tokens=8)
for _ in range(repeats):
    for p in prompts:
        outs = []
        for k, g in gens.items():
            s = g.generate(p, max_new_tokens=64)
            ms[k].append((s.stats.wall_s - s.stats.prefill_s) / s.stats.target_forwards * 1e3)
            outs.append(s.token_ids)
        same &= outs[0] == outs[1]
a, b = (statistics.median(v) for v in ms.values())
print(f"{name} {quant} {method}: old loop {a:.2f} ms, one-row engine {b:.2f} ms per forward, ratio {b / a:.3f}, "
      f"identical tokens: {same}")
