"""A read-only suffix trie in flat integer arrays, for a store of answers kept for good (suffix decoding,
arXiv 2411.04975): the same nodes, counts and child order as :class:`hydraspec.drafters.suffix.SuffixTrie`
built by adding the same answers in order, in a few integers a node instead of a dict per node.

Built at once from the answers' windows (every position's next ``depth`` tokens within its answer) sorted
lexicographically: a node is a distinct window prefix, its count how many windows share the prefix. Nodes are
numbered level by level in sorted order, so each node's children are one contiguous run of ids, sorted by
token (looked up by bisection) and ranked for drafting by count, ties by first occurrence (the dict trie's
insertion order): drafts from either trie are the same.
"""
from __future__ import annotations

from array import array
from bisect import bisect_left

import numpy as np

__all__ = ["FrozenTrie"]


def _windows(seqs: list[list[int]], depth: int) -> tuple[np.ndarray, np.ndarray]:
    """[positions, depth] windows (-1 past an answer's end) and each window's position in the joined answers."""
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    tokens = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs]) if len(seqs) else np.zeros(0, np.int32)
    left = np.repeat(np.cumsum(lengths), lengths) - np.arange(len(tokens))  # tokens left in each one's answer
    win = np.full((len(tokens), depth), -1, dtype=np.int32)
    for k in range(depth):
        fits = left > k
        win[fits, k] = tokens[np.flatnonzero(fits) + k]
    return win, np.arange(len(tokens), dtype=np.int32)


def _levels(seqs: list[list[int]], depth: int) -> tuple[np.ndarray, ...]:
    """Each node's token, count and first position, and where its children start, numbered level by level."""
    win, pos = _windows(seqs, depth)
    order = np.lexsort([pos] + [win[:, k] for k in range(depth - 1, -1, -1)])
    win, pos = win[order], pos[order]
    del order
    # the first column where each window differs from the one before it (depth where equal)
    differs = np.ones((len(win), depth), dtype=bool)
    differs[1:] = win[1:] != win[:-1]
    first_diff = np.where(differs.any(1), differs.argmax(1), depth).astype(np.int8)
    del differs
    tok, count, first, starts = [np.zeros(1, np.int32)], [np.array([len(win)], np.int32)], [np.zeros(1, np.int32)], []
    rows_above = np.zeros(1, np.int32)  # the first window row of each node one level up (the root: row 0)
    for k in range(depth):
        group = np.flatnonzero(first_diff <= k)  # windows that start a new prefix of length k + 1
        real = group[win[group, k] >= 0]  # ... that are nodes (not windows ended before k + 1 tokens)
        at = np.searchsorted(group, real)
        tok.append(win[real, k])
        count.append(np.diff(np.append(group, len(win)))[at].astype(np.int32))
        first.append(np.minimum.reduceat(pos, group)[at] if len(group) else pos[:0])
        starts.append(np.searchsorted(real, rows_above))
        rows_above = real
    starts.append(np.zeros(len(rows_above), np.int64))
    base = np.cumsum([0] + [len(t) for t in tok])
    start = np.concatenate([s + base[k + 1] for k, s in enumerate(starts)] + [base[-1:]])
    return np.concatenate(tok), np.concatenate(count), np.concatenate(first), start


def _ranks(count: np.ndarray, first: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each node's children in :meth:`FrozenTrie.ranked` order, in the node's run of ids; the sum of each node's
    children's counts."""
    parent = np.repeat(np.arange(len(start) - 1, dtype=np.int32), np.diff(start))  # of nodes 1 .. n - 1
    order = np.concatenate([[0], np.lexsort([first[1:], -count[1:], parent]) + 1])
    return order, np.bincount(parent, weights=count[1:], minlength=len(count))


def _ints(values: np.ndarray) -> array:
    """A numpy vector as a compact Python array of int32 (read an item at a time without numpy's overhead)."""
    out = array("i")
    out.frombytes(np.ascontiguousarray(values, dtype=np.int32).tobytes())
    return out


class TrieWalk:
    """Reading a suffix trie from its root, shared by the dict trie and the flat one: each gives ``depth``,
    ``find(node, token)`` (the child, or None) and ``has_children(node)``."""

    ROOT = 0
    depth: int

    def each_match(self, context: list[int]):
        """The nodes of the suffixes of ``context`` (at most depth - 1 tokens) that occurred before with a
        continuation, with their lengths, longest first, each walked from the root only when asked for."""
        for m in range(min(self.depth - 1, len(context)), 0, -1):
            node = self.ROOT
            for t in context[len(context) - m:]:
                node = self.find(node, t)
                if node is None:
                    break
            if node is not None and self.has_children(node):
                yield node, m

    def matches(self, context: list[int]) -> list[tuple[int, int]]:
        """:meth:`each_match`, all at once."""
        return list(self.each_match(context))


class FrozenTrie(TrieWalk):
    """Every suffix of ``seqs`` cut to ``depth`` tokens (see the module docstring); read with
    :meth:`each_match` and :meth:`ranked`, as the drafter reads a :class:`SuffixTrie`."""

    def __init__(self, seqs: list[list[int]], depth: int):
        self.depth = depth
        tok, count, first, start = _levels([s for s in seqs if s], depth)
        order, totals = _ranks(count, first, start)
        self.tok, self.count, self.start = _ints(tok), _ints(count), _ints(start)  # n's children: ids start[n]..
        self.order, self.totals = _ints(order), _ints(totals)
        self.tokens = int(sum(len(s) for s in seqs))

    def __len__(self) -> int:
        return len(self.count)

    def find(self, node: int, token: int) -> int | None:
        lo, hi = self.start[node], self.start[node + 1]
        i = bisect_left(self.tok, token, lo, hi)
        return i if i < hi and self.tok[i] == token else None

    def has_children(self, node: int) -> bool:
        return self.start[node + 1] > self.start[node]

    def total(self, node: int) -> int:
        """The sum of the counts of ``node``'s children."""
        return self.totals[node]

    def ranked(self, node: int):
        """(token, child) pairs by count, most frequent first, ties in order of first occurrence."""
        tok = self.tok
        for k in self.order[self.start[node]:self.start[node + 1]]:
            yield tok[k], k
