"""Growing nested token trees T_1 ⊂ T_2 ⊂ ... ⊂ T_N from calibration ranks, one node at a time.

- `medusa` (Cai et al. 2024, Medusa): a_d^(i) = P(r_d = i), and under independence a path
  [i_0 .. i_{k-1}] is accepted with probability Π_d a_d^(i_d); the expected tokens per verify step of a
  tree is 1 (the target's bonus token) + the sum of its paths' probabilities; add the node with the
  largest one.
- `simulate`: replay decoding on the calibration sequences with the tree (each step accepts the longest
  matching prefix, then moves past the accepted tokens and the bonus token) and add the child that most
  increases the observed mean tokens per step. Candidates are the children of the tree's nodes; the
  `preselect` with the most matching positions are replayed.

Guarantee: every T_n is a tree (each path's prefixes are in it), and the replay walks a calibration
sequence exactly as greedy decoding with T_n would.
"""
from __future__ import annotations

import heapq
from collections import Counter

import numpy as np

from .calibrate import Calibration


def acceptance_table(cal: Calibration) -> np.ndarray:
    """a[d, i] = P(r_d = i): how often the drafter's rank-i proposal at depth d is the target's token."""
    allr = np.concatenate(cal.ranks) if cal.ranks else np.zeros((0, cal.depth), dtype=np.int64)
    a = np.zeros((cal.depth, cal.max_rank))
    if len(allr):
        for d in range(cal.depth):
            a[d] = np.bincount(allr[:, d], minlength=cal.max_rank + 1)[: cal.max_rank] / len(allr)
    return a


def expected_tokens(paths: list[list[int]], a: np.ndarray) -> float:
    """1 + Σ_paths Π_d a[d, path[d]]: expected tokens per verify step under independence."""
    total = 1.0
    for p in paths:
        prob = 1.0
        for d, i in enumerate(p):
            prob *= a[d, i] if d < a.shape[0] and i < a.shape[1] else 0.0
        total += prob
    return total


def grow_medusa(a: np.ndarray, max_nodes: int) -> tuple[list[list[int]], list[float]]:
    """Greedy growth by path probability (paths in the order added: every prefix is a tree).
    Returns the order and the expected tokens per step of T_1 .. T_N."""
    depth, K = a.shape
    heap = [(-float(a[0, i]), (i,)) for i in range(K)]
    heapq.heapify(heap)
    order, exp, total = [], [], 1.0
    while heap and len(order) < max_nodes:
        negp, path = heapq.heappop(heap)
        order.append(list(path))
        total += -negp
        exp.append(total)
        if len(path) < depth:
            for i in range(K):
                heapq.heappush(heap, (negp * float(a[len(path), i]), path + (i,)))
    return order, exp


def _accepted(r: np.ndarray, tree: set) -> int:
    k = 0
    while k < len(r) and tuple(r[: k + 1]) in tree:
        k += 1
    return k


def replay_steps(ranks, tree: set) -> list[int]:
    """Drafts accepted at each verify step when greedy decoding replays one calibration sequence with
    `tree` (a set of rank-path tuples): a step at position p accepts the longest matching prefix of
    r(p) and emits it plus the bonus token, so the next step is at p + accepted + 1.
    ranks: [positions, depth] array, or its rows as tuples."""
    rows = ranks if isinstance(ranks, list) else [tuple(int(x) for x in row) for row in ranks]
    out, p = [], 0
    while p < len(rows):
        acc = _accepted(rows[p], tree)
        out.append(acc)
        p += acc + 1
    return out


def replay(cal: Calibration, tree: set) -> float:
    """Mean tokens per verify step (accepted drafts + the bonus token) over the calibration sequences."""
    tokens = steps = 0
    for r in cal.rows():
        acc = replay_steps(r, tree)
        tokens += sum(acc) + len(acc)
        steps += len(acc)
    return tokens / steps if steps else 1.0


def drafted_nodes(cal: Calibration, paths: list[list[int]]) -> float:
    """Mean number of T's nodes a drafter actually drafts per verify step when greedy decoding replays
    the calibration sequences with T (nodes deeper than the levels drafted at that position are not
    drafted); len(paths) without `cal.levels`."""
    if cal.levels is None:
        return float(len(paths))
    tree = set(map(tuple, paths))
    per_depth = np.bincount([len(p) - 1 for p in paths], minlength=cal.depth)
    cum = np.concatenate([[0], np.cumsum(per_depth)])  # cum[k]: nodes in the first k levels
    total = steps = 0
    for rows, lv in zip(cal.rows(), cal.levels):
        acc = replay_steps(rows, tree)
        at = np.cumsum([0] + [a + 1 for a in acc[:-1]])  # the position of each step
        total += int(cum[np.minimum(lv[at], len(cum) - 1)].sum()) if acc else 0
        steps += len(acc)
    return total / steps if steps else float(len(paths))


def grow_simulate(cal: Calibration, max_nodes: int, preselect: int = 8) -> tuple[list[list[int]], list[float]]:
    """Greedy growth by replayed mean tokens per step (no independence assumption)."""
    counts: Counter = Counter()
    for r in cal.ranks:
        for row in r:
            for k in range(cal.depth):
                if row[k] >= cal.max_rank:
                    break
                counts[tuple(int(x) for x in row[: k + 1])] += 1
    tree: set = set()
    order, exp = [], []
    while len(order) < max_nodes:
        cands = [t for t in counts if t not in tree and (len(t) == 1 or t[:-1] in tree)]
        if not cands:  # nothing observed can be added: grow by the next unused rank, deepest-first order
            cands = [t + (i,) for t in sorted(tree, key=lambda t: (len(t), t)) + [()]
                     for i in range(cal.max_rank) if len(t) < cal.depth and t + (i,) not in tree][:1]
            if not cands:
                break
            best = cands[0]
            score = replay(cal, tree | {best})
        else:
            cands.sort(key=lambda t: (-counts[t], len(t), t))
            scored = [(replay(cal, tree | {t}), -counts[t], t) for t in cands[:preselect]]
            scored.sort(key=lambda x: (-x[0], x[1], len(x[2]), x[2]))
            score, _, best = scored[0]
        tree.add(best)
        order.append(list(best))
        exp.append(score)
    return order, exp


__all__ = ["acceptance_table", "expected_tokens", "grow_medusa", "replay_steps", "replay", "drafted_nodes",
           "grow_simulate"]
