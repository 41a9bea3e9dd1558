from __future__ import annotations

import torch

from ..tree import DraftTree, chain
from .base import DecodeState, Drafter, next_length


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
        self.k = num_tokens
        self.proposed = 0
        self.max_nodes = num_tokens
        self.misses = self.rest = 0

    def start(self, state: DecodeState, capacity: int) -> None:
        self.k = self.num_tokens
        self.misses = self.rest = 0

    def observe(self, state: DecodeState, accepted: list[int]) -> None:
        if self.dynamic and self.proposed:
            self.k = next_length(self.k, len(accepted), self.proposed, self.num_tokens)
            self.misses = 0 if accepted else self.misses + 1
            if self.misses >= self.BACKOFF:
                self.rest = min(2 ** (self.misses - self.BACKOFF), self.MAX_REST)

    def cut(self, n: int) -> None:
        self.proposed = min(self.proposed, n)

    def propose(self, state: DecodeState) -> DraftTree:
        if self.rest:
            self.rest -= 1
            self.proposed = 0
            return DraftTree.empty()
        t = torch.tensor(state.tokens, dtype=torch.long)
        n_tok = t.numel()
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            windows = t[: n_tok - 1].unfold(0, n, 1)  # every n-gram that has at least one token after it
            hits = (windows == t[-n:]).all(1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n
                cand = t[start: start + self.k]
                self.proposed = cand.numel()
                return DraftTree(cand, chain(cand.numel()))
        self.proposed = 0
        return DraftTree.empty()
