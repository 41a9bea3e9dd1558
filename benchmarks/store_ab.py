#!/usr/bin/env python3
"""Suffix stores against each other in one process: plain decoding and ``auto`` with the shipped head (or without one:
``--no-head``), once without a store and once per store given, alternating which goes first prompt by prompt (the
machine's speed drifts within the hour, so only such alternation decides). With ``--head-ab``: plain decoding and
``auto`` with the first store given, once with the head and once without; with ``--heads DIR...``: plain decoding and
``auto`` with the first store and the shipped head, then with each head given instead. Every answer must equal
plain decoding's.
Prints seconds, speedup over plain decoding and tokens per target forward for each.

    python benchmarks/store_ab.py --prompts benchmarks/prompts/everyday.jsonl --limit 2 --stores shipped
    python benchmarks/store_ab.py --prompts benchmarks/prompts/sharegpt.jsonl --skip 40 --limit 26 \\
        --stores shipped other.npz
    python benchmarks/store_ab.py --prompts benchmarks/prompts/everyday.jsonl --limit 2 --head-ab
    python benchmarks/store_ab.py --prompts benchmarks/prompts/everyday.jsonl --limit 2 --heads more-data/
"""
from __future__ import annotations

import argparse
import time

import torch

from hydraspec import SpeculativeGenerator, make_drafter
from hydraspec.bench.prompts import load_questions
from hydraspec.drafters import auto_heads, make_auto
from hydraspec.drafters.suffix import load_store
from hydraspec.heads import load_heads
from hydraspec.models import load_model, shipped_heads, shipped_suffix_store
from hydraspec.models.compile import compile_models

MODEL = "qwen2.5-coder-1.5b-instruct"


def questions(path: str, skip: int, limit: int) -> list[str]:
    """First turns of questions ``skip`` .. ``skip + limit - 1`` of each category, category by category."""
    qs = load_questions([path], limit=limit, skip=skip)
    order = list(dict.fromkeys(q.category for q in qs))
    return [q.turns[0] for q in sorted(qs, key=lambda q: order.index(q.category))]


def auto(target, store: str | None, head: bool | str = True):
    """``auto`` with ``store`` ('shipped', an .npz file or None) and its own copy of the shipped head (none shares
    another's state; ``head``: False for none, as `hydraspec serve` runs by default, or a heads directory)."""
    answers = None if store is None else load_store(shipped_suffix_store(MODEL) if store == "shipped" else store)
    if not head:
        return make_auto(target, store=answers)
    where = str(shipped_heads(MODEL)) if head is True else head
    heads, cfg = load_heads(where, target, base_model=MODEL, drafting=True)
    return make_auto(target, auto_heads(heads, cfg, target.get_input_embeddings()), store=answers)


def drafters(target, stores: list[str], head: bool = True) -> dict:
    """'ar', 'no store' and one ``auto`` per store."""
    return {"ar": make_drafter("ar"), "no store": auto(target, None, head),
            **{name: auto(target, name, head) for name in stores}}


def head_ab(target, store: str) -> dict:
    """'ar', and ``auto`` with ``store`` with the shipped head and without one."""
    return {"ar": make_drafter("ar"), "head": auto(target, store), "no head": auto(target, store, False)}


def heads_ab(target, store: str, dirs: list[str]) -> dict:
    """'ar', ``auto`` with ``store`` and the shipped head, and the same with each head in ``dirs`` instead."""
    return {"ar": make_drafter("ar"), "shipped head": auto(target, store), **{d: auto(target, store, d) for d in dirs}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--limit", type=int, default=2, help="questions of each category")
    ap.add_argument("--stores", nargs="+", default=["shipped"], help="'shipped' or .npz files")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--no-head", action="store_true", help="auto without the shipped head")
    ap.add_argument("--head-ab", action="store_true", help="auto with the first store, with and without the head")
    ap.add_argument("--heads", nargs="+", default=[], metavar="DIR", help="auto with the first store and these heads, "
                    "each against the shipped head")
    a = ap.parse_args()
    torch.set_num_threads(2)
    target, tok = load_model(MODEL, quant="auto")
    compile_models(target, how="auto", hidden=True)
    made = head_ab(target, a.stores[0]) if a.head_ab else heads_ab(target, a.stores[0], a.heads) if a.heads \
        else drafters(target, a.stores, not a.no_head)
    gens = {k: SpeculativeGenerator(target, tok, d) for k, d in made.items()}
    for g in gens.values():
        g.generate([{"role": "user", "content": "Say hi."}], max_new_tokens=8)
    tally = {k: [0.0, 0, 0] for k in gens}  # seconds, new tokens, target forwards
    for i, text in enumerate(questions(a.prompts, a.skip, a.limit)):
        answers = set()
        for k in (list(gens) if i % 2 == 0 else list(gens)[::-1]):
            t0 = time.perf_counter()
            res = gens[k].generate([{"role": "user", "content": text}], max_new_tokens=a.max_new_tokens)
            tally[k][0] += time.perf_counter() - t0
            tally[k][1] += res.stats.new_tokens
            tally[k][2] += res.stats.target_forwards
            answers.add(tuple(res.token_ids))
        if len(answers) != 1:
            raise SystemExit(f"question {i}: the answers differ")
        print(i, {k: round(v[0], 1) for k, v in tally.items()}, flush=True)
    for k, (s, n, f) in tally.items():
        print(f"{k}: {s:.2f} s, {tally['ar'][0] / s:.3f}x ar, {n / f:.3f} tokens a forward")


if __name__ == "__main__":
    main()
