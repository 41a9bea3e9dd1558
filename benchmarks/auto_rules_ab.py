#!/usr/bin/env python3
"""``auto`` with and without one of its rules, in one process: plain decoding, ``auto`` as shipped and ``auto``
without the rule, each with the 0.5B draft model, the shipped head and the shipped suffix store, alternating which
goes first prompt by prompt (the machine's speed drifts within the hour). Every answer must equal plain decoding's.
Prints seconds, speedup over plain decoding and tokens per target forward for each, per category and overall.
The rules (``--without``): ``trials``, new sequences stop trying a costly drafter whose tries have not paid
(``drafters.auto.Trial``); ``sequence-keep``, a sequence stops following a head that does not pay on it
(``drafters.auto.ROW_EVIDENCE``); ``whole-chains``, a chosen chain that was cut is scored whole, so the depths past
the cut keep being measured (``AutoDrafter.whole_chains``); ``agreement``, a cheap offer's first-depth rate scaled
by how offers fared whose top token another drafter's offer shared, or did not (``AutoDrafter.agreement``).

    python benchmarks/auto_rules_ab.py --prompts benchmarks/prompts/everyday.jsonl --limit 2 --without trials
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from hydraspec import SpeculativeGenerator, make_drafter
from hydraspec.bench.prompts import load_questions
from hydraspec.drafters import auto_heads, make_auto
from hydraspec.drafters.auto import Trial
from hydraspec.heads import load_heads
from hydraspec.models import load_draft_model, load_model, shipped_heads
from hydraspec.models.compile import compile_models
from hydraspec.models.loading import shipped_draft_tree, shipped_suffix_store
from hydraspec.options import read_store

MODEL, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


class AlwaysTries(Trial):
    """A trial account that never stops a try (``auto`` before the account)."""

    def pays(self) -> bool:
        return True


def auto(target, draft, tok, dtok, without: str | None = None):
    """``auto`` with its own draft model drafter and head (none shares another's state), without rule ``without``
    (None: as shipped)."""
    heads, cfg = load_heads(str(shipped_heads(MODEL)), target, base_model=MODEL, drafting=True)
    costly = auto_heads(heads, cfg, target.get_input_embeddings())
    costly["draft"] = make_drafter("draft", draft_model=draft, target_tokenizer=tok, draft_tokenizer=dtok,
                                   tree=str(shipped_draft_tree(MODEL, DRAFT)))
    made = make_auto(target, costly, store=read_store(str(shipped_suffix_store(MODEL))))
    if without == "trials":
        made.trials = {n: AlwaysTries() for n in made.trials}
    elif without == "sequence-keep":
        made.row_evidence = float("inf")
    elif without == "whole-chains":
        made.whole_chains = False
    elif without == "agreement":
        made.agreement = False
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--limit", type=int, default=2, help="questions of each category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--without", choices=["trials", "sequence-keep", "whole-chains", "agreement"], default="trials")
    a = ap.parse_args()
    torch.set_num_threads(2)
    target, tok = load_model(MODEL, quant="auto")
    draft, dtok = load_draft_model(DRAFT, "bfloat16", "cpu", tokenizer=tok)
    compile_models(target, draft, how="auto", hidden=True)
    made = {"ar": make_drafter("ar"), "shipped": auto(target, draft, tok, dtok),
            f"without {a.without}": auto(target, draft, tok, dtok, a.without)}
    gens = {k: SpeculativeGenerator(target, tok, d) for k, d in made.items()}
    for g in gens.values():
        g.generate([{"role": "user", "content": "Say hi."}], max_new_tokens=8)
    tally = defaultdict(lambda: [0.0, 0, 0])  # (category, method) -> seconds, new tokens, target forwards
    for i, q in enumerate(load_questions([a.prompts], limit=a.limit, skip=a.skip)):
        answers = set()
        for k in (list(gens) if i % 2 == 0 else list(gens)[::-1]):
            t0 = time.perf_counter()
            res = gens[k].generate([{"role": "user", "content": q.turns[0]}], max_new_tokens=a.max_new_tokens)
            for c in (q.category, "overall"):
                t = tally[c, k]
                t[0], t[1], t[2] = t[0] + time.perf_counter() - t0, t[1] + res.stats.new_tokens, \
                    t[2] + res.stats.target_forwards
            answers.add(tuple(res.token_ids))
        if len(answers) != 1:
            raise SystemExit(f"question {q.question_id}: the answers differ")
        print(i, q.category, {k: round(tally["overall", k][0], 1) for k in gens}, flush=True)
    for c in dict.fromkeys(c for c, _ in tally):
        ar = tally[c, "ar"][0]
        print(c, "  ".join(f"{k} {ar / tally[c, k][0]:.3f}x ({tally[c, k][1] / tally[c, k][2]:.2f})" for k in gens))


if __name__ == "__main__":
    main()
