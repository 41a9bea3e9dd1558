#!/usr/bin/env python3
"""What a decoding loop's steps cost by the tokens in their verify forward, beside the curve the draft policy
prices them on: each method answers every turn of the given conversations (methods alternating conversation by
conversation, each with its own generator, as `hydraspec bench` runs them), and every step after a first turn is
grouped by the tokens its forward read (the pending token and the drafts kept): how many steps, the tokens they
emitted and their median milliseconds (the whole step: drafting, verifying, accepting). Every answer must equal the
first method's.

    python benchmarks/loop_steps.py --methods pld,suffix --prompts benchmarks/prompts/multiturn.jsonl --limit 3
    python benchmarks/loop_steps.py --methods pld,suffix --prompts benchmarks/prompts/sharegpt.jsonl --skip 40 \\
        --limit 12 --json steps.json

A one-turn prompt's only turn is measured.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch

from hydraspec import SpeculativeGenerator, make_drafter
from hydraspec.drafters.suffix import load_store
from hydraspec.models import load_model, shipped_suffix_store
from hydraspec.models.compile import compile_models

MODEL = "qwen2.5-coder-1.5b-instruct"


def generators(target, tok, methods: list[str]) -> dict:
    """One generator a method; suffix decoding with the shipped store, as bench runs it."""
    store = load_store(shipped_suffix_store(MODEL)) if "suffix" in methods else None
    return {m: SpeculativeGenerator(target, tok, make_drafter(m, store=store) if m == "suffix" else make_drafter(m))
            for m in methods}


def record_steps(gen, into: list) -> None:
    """Append (tokens read, tokens emitted, seconds) of each of ``gen``'s greedy steps to ``into``."""
    policy = gen.batch.policy(0.0)
    update = policy.update

    def logged(report):
        into.append((report.tokens, report.emitted, report.seconds))
        return update(report)

    policy.update = logged


def conversations(paths: list[str], skip: int, limit: int) -> list[list[str]]:
    out = []
    for path in paths:
        rows = [json.loads(line) for line in open(path)][skip:skip + limit]
        out += [r["turns"] for r in rows]
    return out


def answer(gen, turns: list[str], steps: list, max_new: int) -> list[list[int]]:
    """Every turn of one conversation; the steps of its first turn are dropped when it has later ones."""
    messages, ids = [], []
    for k, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        mark = len(steps)
        res = gen.generate(messages, max_new_tokens=max_new)
        messages.append({"role": "assistant", "content": res.text})
        ids.append(list(res.token_ids))
        if k == 0 and len(turns) > 1:
            del steps[mark:]
    return ids


def table(name: str, steps: list, points) -> str:
    by = defaultdict(list)
    for n, emitted, seconds in steps:
        by[n].append((emitted, seconds))
    curve = dict(points)
    one = statistics.median(s for _, s in by[1]) if by.get(1) else None
    lines = [f"{name}: {len(steps)} steps, {sum(e for _, e, _ in steps) / len(steps):.3f} tokens a step, "
             f"{1e3 * sum(s for *_, s in steps) / len(steps):.2f} ms a step",
             "| tokens | steps | emitted a step | median ms | x one | start-up curve x one |",
             "|---:|---:|---:|---:|---:|---:|"]
    for n in sorted(by):
        ms = 1e3 * statistics.median(s for _, s in by[n])
        rel = f"{ms / (1e3 * one):.2f}" if one else ""
        cur = f"{curve[n] / curve[1]:.2f}" if n in curve and 1 in curve else ""
        lines.append(f"| {n} | {len(by[n])} | {sum(e for e, _ in by[n]) / len(by[n]):.2f} | {ms:.1f} | {rel} | {cur} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="pld,suffix")
    ap.add_argument("--prompts", nargs="+", default=["benchmarks/prompts/multiturn.jsonl"])
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json", help="write every step (tokens, emitted, seconds) by method here")
    a = ap.parse_args()
    torch.set_num_threads(2)
    target, tok = load_model(MODEL, quant="auto")
    compile_models(target, how="auto", hidden=False)
    methods = a.methods.split(",")
    gens = generators(target, tok, methods)
    steps = {m: [] for m in methods}
    for m, gen in gens.items():
        gen.generate([{"role": "user", "content": "Say hi."}], max_new_tokens=8)
        record_steps(gen, steps[m])
    first: dict[int, list] = {}
    for i, turns in enumerate(conversations(a.prompts, a.skip, a.limit)):
        for m in methods if i % 2 == 0 else methods[::-1]:
            ids = answer(gens[m], turns, steps[m], a.max_new_tokens)
            if first.setdefault(i, ids) != ids:
                raise SystemExit(f"{m}: conversation {i} differs from {methods[0]}'s answers")
    for m in methods:
        print(table(m, steps[m], getattr(gens[m].batch.policy(0.0), "points", [])))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(steps, f)


if __name__ == "__main__":
    main()
