#!/usr/bin/env python3
"""How often a draft model's greedy token is the target's next token, read off a bench run's answers.

The draft model reads each prompt and the target's greedy answer once (one forward, as a prefill); at every
answer position its top token is compared with the token the target wrote there. For greedy speculative decoding
that is the chance a one-token draft is accepted (each draft follows an accepted prefix), without running the
engine: a cheap look at whether a draft model could pay, per category. ``--tail N`` lets the draft model see only
the last N prompt tokens (what a draft that skips most of the prompt's read would see).

    python benchmarks/draft_agreement.py RUN/records.jsonl --prompts benchmarks/prompts/everyday.jsonl \\
        [--draft-model qwen2.5-coder-0.5b-instruct] [--tail 0]

RUN is a ``hydraspec bench --out`` directory whose run had greedy ``ar`` (or any method identical to it) on the
target; its first turns are read. Prints, per category, the agreement and the share of agreeing tokens whose next
token agrees too (how often a second draft would be accepted after a first).
"""
import argparse
import json
from collections import defaultdict

import torch

from hydraspec.bench.prompts import load_prompt_file
from hydraspec.bench.stats import dedupe
from hydraspec.inputs import encode_prompt
from hydraspec.models import load_draft_model


def answers(records: str, methods: tuple[str, ...]):
    """(category, question_id, prompt length, answer ids) of the first turns of ``methods``' records (the run's
    last record of each), each question once."""
    with open(records) as f:
        rows = [r for r in map(json.loads, f) if r.get("method") in methods]
    seen = set()
    for r in dedupe(rows):
        if r["question_id"] not in seen:
            seen.add(r["question_id"])
            t = r["turns"][0]
            yield r["category"], r["question_id"], t["prompt_tokens"], t["token_ids"]


@torch.inference_mode()
def agreement(draft, prompt: list[int], answer: list[int]) -> list[bool]:
    """Whether the draft model's top token at each answer position is the answer's token there."""
    logits = draft(input_ids=torch.tensor([prompt + answer])).logits[0]
    top = logits[len(prompt) - 1:len(prompt) + len(answer) - 1].argmax(-1).tolist()
    return [a == b for a, b in zip(top, answer)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", help="a bench run's records.jsonl")
    ap.add_argument("--prompts", required=True, help="the prompt file the run read (Spec-Bench format)")
    ap.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--methods", default="ar", help="whose answers to read (comma-separated)")
    ap.add_argument("--tail", type=int, default=0, help="the draft model sees only the last N prompt tokens")
    args = ap.parse_args()
    draft, tok = load_draft_model(args.draft_model, "bfloat16", "cpu", quant=None)
    questions = {(q.category, q.question_id): q for q in load_prompt_file(args.prompts)}
    per = defaultdict(lambda: [0, 0, 0])  # agreeing, answer tokens, agreeing twice in a row
    for cat, qid, n, ans in answers(args.records, tuple(args.methods.split(","))):
        prompt = encode_prompt(tok, questions[(cat, qid)].turns[0], True)
        if len(prompt) != n:
            raise SystemExit(f"question {qid}: {len(prompt)} prompt tokens with the draft's tokenizer, {n} in the run")
        ok = agreement(draft, prompt[-args.tail:] if args.tail else prompt, ans)
        c = per[cat]
        c[0], c[1] = c[0] + sum(ok), c[1] + len(ok)
        c[2] += sum(a and b for a, b in zip(ok, ok[1:]))
    print("| category | answer tokens | agreement | the next one too |\n|---|---:|---:|---:|")
    for cat, (hit, n, two) in list(per.items()) + [("overall", [sum(v[i] for v in per.values()) for i in range(3)])]:
        print(f"| {cat} | {n} | {hit / max(1, n):.3f} | {two / max(1, hit):.3f} |")


if __name__ == "__main__":
    main()
