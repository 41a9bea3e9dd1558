#!/usr/bin/env python3
"""What the ``auto`` method's drafting costs per step, without a model: R rows decode texts whose next
tokens are known (Python standard-library sources, split into words and punctuation, a word an id), each
step every row asks ``AutoDrafter.propose``, keeps its proposal's matching prefix (greedy verification
against the text) plus one token, and the drafter learns the verdicts and a step time from a fixed
verify-cost curve. Prints milliseconds of drafter work per step (propose + observe) by row count.

    python benchmarks/auto_overhead.py --rows 1,4,8 --steps 300
"""
from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import sysconfig
import time

from hydraspec.drafters import make_auto
from hydraspec.drafters.auto import AutoDrafter
from hydraspec.drafters.base import DecodeState, Verdict
from hydraspec.sampling import Sampling
from hydraspec.verify_cost import Curve

COST = {1: 0.040, 2: 0.040, 4: 0.043, 6: 0.052, 8: 0.070, 12: 0.094, 16: 0.125, 24: 0.185, 32: 0.25}


def texts(n: int, words: int) -> list[list[int]]:
    """``n`` token sequences of ``words`` ids each from the standard library's sources (one vocabulary)."""
    vocab: dict[str, int] = {}
    out = []
    for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        toks = re.findall(r"\w+|[^\w\s]", path.read_text(errors="ignore"))
        if len(toks) >= words:
            out.append([vocab.setdefault(t, len(vocab)) for t in toks[:words]])
        if len(out) == n:
            break
    return out


def accepted(tree, truth: list[int]) -> list[int]:
    """Node indices of the tree's path that equals ``truth``'s first tokens (greedy verification)."""
    path, parent = [], -1
    for want in truth:
        nxt = [i for i, p in enumerate(tree.parents) if p == parent and int(tree.tokens[i]) == want]
        if not nxt:
            break
        parent = nxt[0]
        path.append(parent)
    return path


def run(rows: int, steps: int, prompt: int, seqs: list[list[int]]) -> float:
    auto: AutoDrafter = make_auto(None, cost=COST)
    cost = Curve(COST)
    states = [DecodeState(list(s[:prompt]), prompt, Sampling(0.0, 0, 1.0), capacity=len(s) + 64) for s in seqs[:rows]]
    took = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trees = auto.propose(states)
        verdicts = []
        for s, tree, full in zip(states, trees, seqs):
            at = len(s.tokens)
            path = accepted(tree, full[at:at + len(tree) + 1])
            verdicts.append(Verdict(path, len(tree)))
            t1 = time.perf_counter()
            s.tokens.extend(full[at:at + len(path) + 1])
            t0 += time.perf_counter() - t1  # the text's bookkeeping is not the drafter's
        auto.observe(states, verdicts)
        nodes = rows + sum(len(t) for t in trees)
        auto.step_took(rows, nodes, cost(nodes))
        took.append(time.perf_counter() - t0)
    return statistics.median(took) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompt", type=int, default=1000, help="tokens of each row before the first step")
    a = ap.parse_args()
    rows = [int(x) for x in a.rows.split(",")]
    seqs = texts(max(rows), a.prompt + 4 * a.steps + 64)
    for r in rows:
        print(f"{r} rows: {run(r, a.steps, a.prompt, seqs):.3f} ms of drafting per step (median of {a.steps})",
              flush=True)


if __name__ == "__main__":
    main()
