"""Predicted outputs (OpenAI's ``prediction`` parameter): a text the caller expects the answer to mostly
repeat (the current code of a file being edited) is a draft source. Each sequence keeps its place in the
prediction: after the answer follows the prediction for a while the next tokens of it are proposed; where
the answer departs, the place is found again by the answer's last n-gram (n from max_ngram down to
min_ngram), preferring the first occurrence at or after the old place. No model runs; proposals are
deterministic, so the output is the target's whatever the prediction says.

Counts for the response's usage go to DecodeState.counters: ``accepted_prediction_tokens`` (proposed
prediction tokens the target accepted) and ``rejected_prediction_tokens`` (proposed and verified, not
accepted).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree import DraftTree, chain
from .base import DecodeState, Drafter, RowStates, Verdict


@dataclass
class PredictionRow:
    place: int = 0  # index into the prediction of the token expected next (-1: lost)
    anchor: int = 0  # the last place the answer was known to follow
    seen: int = 0  # answer tokens already followed
    proposed: int = 0  # tokens of the last proposal


class PredictionDrafter(Drafter):
    """Drafts from each sequence's DecodeState.prediction (token ids; none: no proposal)."""

    name = "prediction"
    cheap = True

    def __init__(self, num_tokens: int = 32, max_ngram: int = 4, min_ngram: int = 2):
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.max_nodes = num_tokens
        self.rows: RowStates[PredictionRow] = RowStates(lambda s: PredictionRow(seen=s.prompt_len))

    def propose(self, states: list[DecodeState]) -> list[DraftTree]:
        out = []
        for s in states:
            row = self.rows.of(s)
            if not s.prediction:
                out.append(DraftTree.empty())
                continue
            self._follow(row, s)
            cand = s.prediction[row.place: row.place + self.num_tokens] if row.place >= 0 else []
            row.proposed = len(cand)
            out.append(DraftTree(torch.tensor(cand, dtype=torch.long), chain(len(cand))))
        return out

    def observe(self, states: list[DecodeState], verdicts: list[Verdict]) -> None:
        for s, v in zip(states, verdicts):
            row = self.rows.get(s)
            if row is None or not s.prediction:
                continue
            verified = min(row.proposed, v.verified)
            accepted = min(len(v.accepted), verified)
            s.counters["accepted_prediction_tokens"] = s.counters.get("accepted_prediction_tokens", 0) + accepted
            s.counters["rejected_prediction_tokens"] = s.counters.get("rejected_prediction_tokens", 0) + \
                verified - accepted

    def _follow(self, row: PredictionRow, s: DecodeState) -> None:
        """Move the place along the answer tokens decoded since the last call."""
        pred, toks = s.prediction, s.tokens
        for t in toks[row.seen:]:
            if 0 <= row.place < len(pred) and pred[row.place] == t:
                row.place += 1
                row.anchor = row.place
            else:
                row.place = -1
        if row.place < 0:
            row.place = self._realign(pred, toks[s.prompt_len:], row.anchor)
        row.seen = len(toks)

    def _realign(self, pred: list[int], answer: list[int], near: int) -> int:
        """The place after the answer's last n-gram in the prediction (-1: none); at the start of an answer
        the prediction's beginning."""
        if not answer:
            return 0
        for n in range(min(self.max_ngram, len(answer)), self.min_ngram - 1, -1):
            gram = answer[-n:]
            hits = [i + n for i in range(len(pred) - n + 1) if pred[i:i + n] == gram]
            if hits:
                ahead = [h for h in hits if h >= near]
                return ahead[0] if ahead else hits[-1]
        return -1
