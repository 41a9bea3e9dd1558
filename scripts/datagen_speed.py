"""Self-distillation answers per hour with plain decoding and with prompt lookup, same prompts, one process.

    python scripts/datagen_speed.py smollm2-135m-instruct float32 ../shared/data/prompts/humaneval.jsonl \
        ../shared/data/prompts/sharegpt.jsonl --skip 10 --limit 16 --batch-size 8
    python scripts/datagen_speed.py qwen2.5-coder-1.5b-instruct bfloat16 --quant gguf benchmarks/prompts/humaneval.jsonl \
        benchmarks/prompts/sharegpt.jsonl --skip 10 --limit 8 --batch-size 8 --max-new-tokens 128
"""
import argparse
import json
import os
import tempfile
import time

import torch

from hydraspec.bench.prompts import load_questions
from hydraspec.models import load_model
from hydraspec.train import answer_prompts

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("dtype")
ap.add_argument("prompts", nargs="+")
ap.add_argument("--skip", type=int, default=10)
ap.add_argument("--limit", type=int, default=16)
ap.add_argument("--batch-size", type=int, default=8)
ap.add_argument("--max-new-tokens", type=int, default=256)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--quant", default="none", help="gguf: the file's own precision (registry GGUF models)")
args = ap.parse_args()
torch.set_num_threads(2)
model, tok = load_model(args.model, dtype=args.dtype, quant=args.quant, progress=False)
pairs = [(f"{q.source}-{q.question_id}", q.turns) for q in load_questions(args.prompts, limit=args.limit, skip=args.skip)]
answers = {}
for rnd in range(args.rounds):
    for method in (("ar", "pld") if rnd % 2 == 0 else ("pld", "ar")):  # alternate which goes first
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "answers.jsonl")
            t = time.perf_counter()
            answer_prompts(model, tok, pairs, path, max_new_tokens=args.max_new_tokens, progress=False,
                           batch_size=args.batch_size, method=method)
            dt = time.perf_counter() - t
            rows = [json.loads(line) for line in open(path)]
        answers[method] = {r["id"]: r["answer_ids"] for r in rows}
        n_tok = sum(len(r["answer_ids"]) for r in rows)
        print(f"round {rnd} {method}: {len(rows)} answers in {dt:.1f} s = {len(rows) / dt * 3600:.0f} answers/h, "
              f"{n_tok / dt:.1f} tokens/s", flush=True)
same = sum(answers["ar"][k] == answers["pld"].get(k) for k in answers["ar"])
print(f"same answers: {same}/{len(answers['ar'])}")
