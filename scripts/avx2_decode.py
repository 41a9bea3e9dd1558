"""Decode ms per token of the Qwen2.5-Coder-1.5B GGUF at the file's precision with the AVX2 build of the native
kernels put in place of the AVX-512 one (what an AVX2-only CPU runs), or the default build; run both in turn:

    python scripts/avx2_decode.py avx2; python scripts/avx2_decode.py avx512
"""
import sys

import torch

import hydraspec.cpu.kernels as k
if sys.argv[1] == "avx2":
    lib = k.build_native("avx2")
    k.native_lib = lambda: lib
    k.int8_dot_lib = lambda: lib
    k.fused_lib = lambda: lib
from hydraspec.models import load_model
from hydraspec import SpeculativeGenerator, make_drafter
torch.set_num_threads(2)
model, tok = load_model("qwen2.5-coder-1.5b-instruct", quant="gguf", progress=False)
g = SpeculativeGenerator(model, tok, make_drafter("ar"))
p = "Write a Python function that checks whether a number is prime."
g.generate(p, max_new_tokens=8)
ts = []
for _ in range(3):
    r = g.generate(p, max_new_tokens=48)
    s = r.stats
    ts.append((s.wall_s - s.prefill_s) / max(1, s.new_tokens - 1) * 1e3)
print(sys.argv[1], "decode ms/token", [round(x, 1) for x in ts], "prefill s", round(s.prefill_s, 3), "tokens", r.token_ids[:8])
