"""A batch of 4 chat prompts (ShareGPT 20-23, first turns, 64 new tokens) on the Qwen2.5-Coder-1.5B GGUF: `ar`
against `pld` under the server's adaptive rule (hydraspec.adaptive), twice each, in one process; prints tokens/s, the
verify time of the 4-row steps and the rule's draft length per number of rows.

    python scripts/batch_adaptive_probe.py
"""
import json
import statistics
import time

import torch

from hydraspec import make_drafter
from hydraspec.adaptive import AdaptiveDraft, measure_verify_cost
from hydraspec.batch import BatchGenerator
from hydraspec.models import load_model

torch.set_num_threads(2)
model, tok = load_model("qwen2.5-coder-1.5b-instruct", quant="gguf", progress=False)
qs = [json.loads(l) for l in open("benchmarks/prompts/sharegpt.jsonl")][20:24]
prompts = [[{"role": "user", "content": q["turns"][0]}] for q in qs]
cost = measure_verify_cost(model)
print("cost ms", {n: round(s * 1e3, 1) for n, s in cost.items()})
for method in ("ar", "pld", "ar", "pld"):
    bg = BatchGenerator(model, tok, make_drafter(method))
    log = []
    ad = AdaptiveDraft(cost, 10) if method == "pld" else None
    orig_engine = bg.engine
    def engine(*a, **k):
        e = orig_engine(*a, **k)
        step = e.step
        def spy():
            t = time.perf_counter(); d = step()
            log.append((e.last_rows, time.perf_counter() - t, getattr(e, "last_verify_s", 0.0)))
            return d
        e.step = spy
        return e
    bg.engine = engine
    r = bg.generate(prompts, max_new_tokens=64, batch_size=4, adaptive=ad)
    toks = sum(len(x.token_ids) for x in r.results)
    steps4 = [x for x in log if x[0] == 4]
    print(method, f"{toks / r.wall_s:.1f} tok/s, {len(log)} steps, 4-row steps: mean step {statistics.mean(s[1] for s in steps4) * 1e3:.1f} ms, verify {statistics.mean(s[2] for s in steps4) * 1e3:.1f} ms",
          "" if ad is None else ad.describe())
