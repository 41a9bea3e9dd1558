"""Suffix decoding (Oliaro et al., SuffixDecoding, arXiv 2411.04975): drafts from suffix tries over the
sequence so far and over earlier answers, with no model at all.

A :class:`SuffixTrie` holds every suffix of its sequences cut to ``depth`` tokens, each node counting how
often its path occurred. To draft, the longest suffix of the context (at most ``depth`` tokens) that
occurred before with a continuation is found; from its node a tree grows best first by the empirical
probability of each path (a child's count over its parent's), up to a size that follows the match length
(``alpha`` tokens per matched token) and never below ``min_prob``. Two tries are asked: the sequence's own
(prompt and answer so far) and one shared by every sequence, fed each finished answer and bounded in
tokens (the oldest answer goes first), so that a request like earlier ones drafts from their answers; and,
where given, a third over a store of answers kept for good (``store``: e.g. the model's own answers to many
kinds of request, shipped with it).

Proposals are deterministic (q is one-hot), so greedy output is plain decoding's and lossless sampling
stays exact; sampling uses the most probable path only.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from ..backend import release_free_memory
from ..tree import DraftTree
from .base import DecodeState, Drafter, RowStates, Verdict
from .frozen_trie import FrozenTrie, TrieWalk


class SuffixTrie(TrieWalk):
    """Every suffix of every sequence added, cut to ``depth`` tokens; nodes count their occurrences.

    Nodes are integer ids (0 is the root) into two lists: each node's children, a dict of token -> node, and
    its count; the ids of removed nodes are reused. The dicts hold only integers, so Python's garbage
    collector never tracks them: a server's tries of millions of nodes add nothing to its collections (as
    objects, each full collection walked them all, a pause of half a second and more between two tokens)."""

    def __init__(self, depth: int = 24):
        self.depth = depth
        self.kids: list[dict[int, int]] = [{}]
        self.count: list[int] = [0]
        self.free: list[int] = []
        self.tokens = 0  # tokens added and not removed

    def child(self, node: int, token: int) -> int:
        """The child of ``node`` by ``token``, made (with count 0) if there is none."""
        kid = self.kids[node].get(token)
        if kid is None:
            if self.free:
                kid = self.free.pop()
                self.kids[kid], self.count[kid] = {}, 0
            else:
                kid = len(self.count)
                self.kids.append({})
                self.count.append(0)
            self.kids[node][token] = kid
        return kid

    def add(self, seq: list[int]) -> None:
        self._walk(seq, +1)

    def remove(self, seq: list[int]) -> None:
        self._walk(seq, -1)

    def _walk(self, seq: list[int], step: int) -> None:
        for i in range(len(seq)):
            node = self.ROOT
            for t in seq[i:i + self.depth]:
                nxt = self.child(node, t)
                self.count[nxt] += step
                if self.count[nxt] <= 0:
                    del self.kids[node][t]
                    self._drop(nxt)
                    break
                node = nxt
        self.tokens += step * len(seq)

    def _drop(self, node: int) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(self.kids[n].values())
            self.kids[n] = {}
            self.free.append(n)

    def extend(self, active: list[int], token: int) -> list[int]:
        """Append ``token`` to a sequence whose open suffixes end at ``active`` (the nodes of its last
        depth - 1 suffixes, longest first); returns the new open suffixes."""
        out = []
        for node in active + [self.ROOT]:
            nxt = self.child(node, token)
            self.count[nxt] += 1
            out.append(nxt)
        self.tokens += 1
        return out[-(self.depth - 1):] if self.depth > 1 else []

    def find(self, node: int, token: int) -> int | None:
        """The child of ``node`` by ``token``, or None (nothing is made)."""
        return self.kids[node].get(token)

    def has_children(self, node: int) -> bool:
        return bool(self.kids[node])

    def ranked(self, node: int) -> list[tuple[int, int]]:
        """(token, child) pairs by count, most frequent first, ties in the order they were made."""
        return sorted(self.kids[node].items(), key=lambda kv: -self.count[kv[1]])

    def total(self, node: int) -> int:
        """The sum of the counts of ``node``'s children."""
        return sum(self.count[k] for k in self.kids[node].values())

    def matches_open(self, active: list[int]) -> list[tuple[int, int]]:
        """:meth:`matches` for the sequence this trie holds whole, from its open suffixes (as :meth:`extend`
        returns them, longest first), without walking from the root."""
        return [(node, len(active) - i) for i, node in enumerate(active) if self.kids[node]]


@dataclass
class Speculation:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # each node's path probability
    matched: int = 0  # the length of the match it grew from

    @property
    def score(self) -> float:
        return sum(self.probs)


def speculate(trie: SuffixTrie | FrozenTrie, node: int, budget: int, min_prob: float,
              chain_only: bool = False) -> Speculation:
    """A tree of at most ``budget`` nodes below ``node`` of ``trie``, grown best first by path probability (a
    child's count over the sum of its siblings' counts, times its parent's), nodes below ``min_prob`` left out;
    BFS order. ``chain_only``: the most probable path."""
    made: list[tuple[int, int, float, int]] = []  # (token, parent index, path prob, depth)
    heap = [(-1.0, 0, -1, node)]  # (-prob, tie, parent index, node)
    tie = 1
    while heap and len(made) < budget:
        neg, _, _, cur = heapq.heappop(heap)
        idx = len(made) - 1
        total = trie.total(cur)
        for t, kid in trie.ranked(cur):
            p = -neg * trie.count[kid] / total
            if p < min_prob:
                break
            made.append((t, idx, p, 0 if idx < 0 else made[idx][3] + 1))
            if len(made) >= budget:
                break
            heapq.heappush(heap, (-p, tie, len(made) - 1, kid))
            tie += 1
            if chain_only:
                break
    return bfs(made)


def bfs(made: list[tuple[int, int, float, int]]) -> Speculation:
    """Nodes (token, parent, prob, depth) reordered breadth first (depth, then order made)."""
    order = sorted(range(len(made)), key=lambda i: (made[i][3], i))
    pos = {old: new for new, old in enumerate(order)}
    out = Speculation()
    for i in order:
        t, p, prob, _ = made[i]
        out.tokens.append(t)
        out.parents.append(-1 if p < 0 else pos[p])
        out.probs.append(prob)
    return out


def match_grade(matched: int) -> int:
    """A proposal's grade (DraftTree.grade) from its match length: 1, 2, 3, 4, 5 (5-7 tokens), 8 (8 or more).
    How often its first draft is accepted grows with the match (BENCHMARKS.md: a fifth after one matched
    token, four in five after eight or more), which the path probabilities alone do not tell: a match seen
    once gives every path probability 1."""
    return matched if matched < 5 else 5 if matched < 8 else 8


STORE_DEPTH = 8  # a store's suffixes are cut to this many tokens: fewer nodes, drafts as good (BENCHMARKS.md)


class SharedAnswers:
    """The shared trie: finished answers, at most ``max_tokens`` tokens of them (the oldest go first)."""

    def __init__(self, depth: int, max_tokens: int):
        self.trie = SuffixTrie(depth)
        self.max_tokens = max_tokens
        self.seqs: OrderedDict[int, list[int]] = OrderedDict()

    def add(self, key: int, seq: list[int]) -> None:
        if not seq or self.max_tokens <= 0:
            return
        seq = seq[-self.max_tokens:]
        self.trie.add(seq)
        self.seqs[key] = seq
        while self.trie.tokens > self.max_tokens:
            _, old = self.seqs.popitem(last=False)
            self.trie.remove(old)


_STORE_TRIES: dict[int, tuple[list[list[int]], FrozenTrie]] = {}  # id -> (the store, its trie)


def store_trie(store: list[list[int]]) -> FrozenTrie:
    """A store of answers as a trie of its own, beside the shared one: its counts would dilute the path
    probabilities that the process's own earlier answers give (BENCHMARKS.md: a run of like requests). Built
    once per store object in a process and shared by every drafter given it: the trie is only read, so it is
    a :class:`FrozenTrie` (flat arrays: far less memory than dicts, BENCHMARKS.md)."""
    kept = _STORE_TRIES.get(id(store))
    if kept is None or kept[0] is not store:
        kept = _STORE_TRIES[id(store)] = (store, FrozenTrie(store, STORE_DEPTH))
        release_free_memory()  # the build's sorted windows
    return kept[1]


def load_store(path) -> list[list[int]]:
    """Answers kept in a file for suffix decoding to draft from in every process (``scripts/build_suffix_store.py``
    writes one from `train-heads --data-only` answers): an ``.npz`` of ``tokens`` (every answer's ids, one after
    another) and ``ends`` (where each answer ends)."""
    with np.load(path) as f:
        tokens, ends = f["tokens"].tolist(), f["ends"].tolist()
    return [tokens[a:b] for a, b in zip([0] + ends[:-1], ends)]


@dataclass
class SuffixRow:
    trie: SuffixTrie
    active: list[int]
    added: int  # tokens of the sequence in its own trie


class SuffixDrafter(Drafter):
    """Suffix decoding (see the module docstring). ``max_tokens``: the most nodes a tree holds; ``alpha``:
    tree nodes per matched token; ``min_prob``: the least path probability a node may have; ``depth``: the
    longest suffix kept; ``shared_tokens``: the size of the shared trie of earlier answers in tokens (0: none;
    its memory grows with tokens x depth, measured in BENCHMARKS.md); ``store``: answers kept for good in a
    trie of their own, asked beside the others (:func:`load_store`), e.g. the model's own answers to many kinds
    of request."""

    name = "suffix"
    cheap = True

    def __init__(self, max_tokens: int = 16, alpha: float = 2.0, min_prob: float = 0.1, depth: int = 24,
                 shared_tokens: int = 50_000, store: list[list[int]] | None = None):
        self.max_tokens, self.alpha, self.min_prob, self.depth = max_tokens, alpha, min_prob, depth
        self.max_nodes = max_tokens
        self.shared = SharedAnswers(depth, shared_tokens)
        self.store = store_trie(store) if store else None
        self.rows: RowStates[SuffixRow] = RowStates(self._start)

    def _start(self, state: DecodeState) -> SuffixRow:
        trie = SuffixTrie(self.depth)
        row = SuffixRow(trie, [], 0)
        self._catch_up(row, state.tokens)
        return row

    def _catch_up(self, row: SuffixRow, tokens: list[int]) -> None:
        for t in tokens[row.added:]:
            row.active = row.trie.extend(row.active, t)
        row.added = len(tokens)

    def propose(self, states: list[DecodeState]) -> list[DraftTree]:
        self._keep_answers()
        out = []
        for s in states:
            spec = self.speculate(self.rows.of(s), s)
            out.append(DraftTree(torch.tensor(spec.tokens, dtype=torch.long), tuple(spec.parents),
                                 grade=match_grade(spec.matched)))
        return out

    def speculate(self, row: SuffixRow, state: DecodeState, min_prob: float | None = None) -> Speculation:
        """The best tree (by expected accepted tokens) over the sequence's own trie and the shared trie and
        over every match length: a long match leaves few levels of the trie below it (suffixes are cut to
        ``depth`` tokens), so a shorter one may speculate further (as SuffixDecoding's reference code tries
        every pattern length). Lengths whose size bound (``alpha`` per matched token) cannot beat the best
        tree so far are not tried."""
        self._catch_up(row, state.tokens)
        floor = self.min_prob if min_prob is None else min_prob
        best = Speculation()
        for trie in (row.trie, self.shared.trie) + ((self.store,) if self.store is not None else ()):
            found = trie.matches_open(row.active) if trie is row.trie else trie.each_match(state.tokens)
            for node, m in found:
                budget = min(self.max_tokens, max(1, int(self.alpha * m)))
                if budget <= best.score:
                    break
                spec = speculate(trie, node, budget, floor, chain_only=not state.sampling.greedy)
                if spec.score > best.score:
                    best, spec.matched = spec, m
        return best

    def observe(self, states: list[DecodeState], verdicts: list[Verdict]) -> None:
        """Nothing to learn from a verdict; answers join the shared trie once their sequence is done."""

    def forget(self) -> None:
        self.rows.sweep()
        self.shared = SharedAnswers(self.depth, self.shared.max_tokens)

    def _keep_answers(self) -> None:
        for key, (state, _) in self.rows.rows.items():
            if state.done:
                self.shared.add(key, state.tokens[state.prompt_len:])
        self.rows.sweep()
