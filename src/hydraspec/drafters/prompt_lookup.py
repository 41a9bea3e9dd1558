from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree import DraftTree, chain
from .base import DecodeState, Drafter, RowStates, Verdict, next_length


@dataclass
class LookupRow:
    k: int  # the current proposal length
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
        self.rows: RowStates[LookupRow] = RowStates(lambda s: LookupRow(num_tokens))

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
        cand = lookup(tokens, row.k, self.max_ngram, self.min_ngram)
        row.proposed = cand.numel()
        return DraftTree(cand, chain(cand.numel()))


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
