from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..tree import DraftTree, chain
from .base import DecodeState, Drafter, RowStates, Verdict, next_length


@dataclass
class LookupRow:
    k: int  # the current proposal length
    grams: NgramIndex  # the sequence's n-grams, kept up to date as it grows
    proposed: int = 0  # tokens of the last proposal
    misses: int = 0  # proposals in a row that were all rejected
    rest: int = 0  # steps left without looking


class PromptLookupDrafter(Drafter):
    """Prompt lookup decoding (Saxena 2023): find the latest earlier occurrence of the last n-gram of
    prompt + output (n from max_ngram down to min_ngram) and propose the tokens that followed it.
    With `dynamic`, the proposal length follows the draft-model heuristic: +2 after a step that
    accepted everything, -1 otherwise, between 1 and num_tokens, and after BACKOFF proposals in a row
    that were all rejected it proposes nothing for 1, 2, 4 ... (at most MAX_REST) steps before it looks
    again, so that on text that never repeats it costs almost nothing over plain decoding (a rejected
    proposal still costs a wider verify forward). Deterministic (q is one-hot), so lossless sampling
    stays exact."""

    BACKOFF, MAX_REST = 3, 16

    name = "pld"
    cheap = True

    def __init__(self, num_tokens: int = 10, max_ngram: int = 3, min_ngram: int = 2, dynamic: bool = True):
        if num_tokens < 1 or min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError("prompt lookup needs num_tokens >= 1 and 1 <= min_ngram <= max_ngram")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.dynamic = dynamic
        self.max_nodes = num_tokens
        self.rows: RowStates[LookupRow] = RowStates(
            lambda s: LookupRow(num_tokens, NgramIndex(self.min_ngram, self.max_ngram)))

    def propose(self, states: list[DecodeState]) -> list[DraftTree]:
        return [self.propose_one(self.rows.of(s), s.tokens) for s in states]

    def observe(self, states: list[DecodeState], verdicts: list[Verdict]) -> None:
        for s, v in zip(states, verdicts):
            row = self.rows.get(s)
            if row is None or not self.dynamic:
                continue
            proposed = min(row.proposed, v.verified)
            if proposed:
                row.k = next_length(row.k, len(v.accepted), proposed, self.num_tokens)
                row.misses = 0 if v.accepted else row.misses + 1
                if row.misses >= self.BACKOFF:
                    row.rest = min(2 ** (row.misses - self.BACKOFF), self.MAX_REST)

    def propose_one(self, row: LookupRow, tokens: list[int]) -> DraftTree:
        if row.rest:
            row.rest -= 1
            row.proposed = 0
            return DraftTree.empty()
        found = row.grams.lookup(tokens, row.k)
        row.proposed = len(found)
        return DraftTree(torch.tensor(found, dtype=torch.long), chain(len(found)))


@dataclass
class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of a growing sequence last started, among those with a token
    after them; a step adds only the new n-grams, so a lookup costs the same at any length.
    :meth:`lookup` proposes what :func:`lookup` proposes."""

    min_n: int
    max_n: int
    starts: dict[tuple[int, ...], int] = field(default_factory=dict)
    ends: int = 0  # n-grams ending before this position are in ``starts``

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix n-gram."""
        if len(tokens) <= self.ends:  # not the sequence it has seen grow: start over
            self.starts, self.ends = {}, 0
        for end in range(self.ends + 1, len(tokens)):  # n-grams with at least one token after them
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.starts[tuple(tokens[end - n:end])] = end - n
        self.ends = max(self.ends, len(tokens) - 1)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self.starts.get(tuple(tokens[len(tokens) - n:]))
            if start is not None:
                return tokens[start + n:start + n + k]
        return []


def lookup(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> torch.Tensor:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix n-gram of
    ``tokens`` (n from max_ngram down to min_ngram); empty where none occurs."""
    t = torch.tensor(tokens, dtype=torch.long)
    n_tok = t.numel()
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        windows = t[: n_tok - 1].unfold(0, n, 1)  # every n-gram that has at least one token after it
        hits = (windows == t[-n:]).all(1).nonzero().flatten()
        if hits.numel():
            start = int(hits[-1]) + n
            return t[start: start + k]
    return t[:0]
