"""Batched decoding under the server's adaptive rule (hydraspec.adaptive) on the Qwen2.5-Coder-1.5B GGUF:
`ar` against `pld` with packed verification and with padded rows, interleaved in one process, on the first
turns of the serving benchmark's prompts (ShareGPT and HumanEval 20-23). Prints tokens/s per run and the rule's
state.

    python scripts/batch_adaptive_probe.py --rows 8 --rounds 2
"""
import argparse
import time

import torch

from hydraspec import make_drafter
from hydraspec.adaptive import AdaptiveDraft
from hydraspec.verify_cost import measure_verify_cost
from hydraspec.batch import BatchGenerator
from hydraspec.bench.prompts import load_questions
from hydraspec.models import load_model

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
ap.add_argument("--rows", type=int, default=8)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--max-new-tokens", type=int, default=128)
ap.add_argument("--methods", default="ar,pld,pld-padded")
args = ap.parse_args()

torch.set_num_threads(2)
model, tok = load_model(args.model, quant="gguf", progress=False)
qs = load_questions(["benchmarks/prompts/sharegpt.jsonl", "benchmarks/prompts/humaneval.jsonl"], limit=4, skip=20)
prompts = [[{"role": "user", "content": q.turns[0]}] for q in qs]
cost = measure_verify_cost(model)
print("verify cost ms", {n: round(s * 1e3, 1) for n, s in cost.items()})
for rnd in range(args.rounds):
    for method in args.methods.split(","):
        drafter = make_drafter(method.split("-")[0])
        bg = BatchGenerator(model, tok, drafter)
        rule = None if method == "ar" else AdaptiveDraft(cost, drafter.max_nodes, cheap=drafter.cheap)
        make_engine = bg.engine

        def engine(*a, _make=make_engine, _method=method, **k):
            e = _make(*a, **k)
            e.packed = e.packed and not _method.endswith("padded")
            return e
        bg.engine = engine
        t = time.perf_counter()
        r = bg.generate(prompts, max_new_tokens=args.max_new_tokens, batch_size=args.rows, adaptive=rule)
        wall = time.perf_counter() - t
        toks = sum(len(x.token_ids) for x in r.results)
        print(f"round {rnd} {method}: {toks / wall:.2f} tokens/s ({toks} tokens, {wall:.1f} s, {r.target_forwards} "
              f"verify forwards)" + ("" if rule is None else f"; {rule.describe()}"), flush=True)
