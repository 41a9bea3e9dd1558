"""What a decoding run returns: the tokens, the text, why it stopped, and the per-step statistics."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

__all__ = ["Stats", "GenerationResult"]


@dataclass
class Stats:
    """new_tokens / target_forwards is the mean number of tokens accepted per target forward after
    prefill (plain decoding = 1.00). accept_hist[i] counts forwards that emitted i tokens."""

    new_tokens: int = 0
    target_forwards: int = 0
    accept_hist: list[int] = field(default_factory=lambda: [0])
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    wall_s: float = 0.0
    prompt_tokens: int = 0
    counters: dict = field(default_factory=dict)  # drafters' counts (e.g. accepted_prediction_tokens)

    @property
    def mean_accepted(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def count(self, emitted: int) -> None:
        while len(self.accept_hist) <= emitted:
            self.accept_hist.append(0)
        self.accept_hist[emitted] += 1

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mean_accepted"] = round(self.mean_accepted, 4)
        d["tokens_per_s"] = round(self.tokens_per_s, 4)
        return d


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # new tokens only (an EOS that ended the answer included)
    prompt_ids: list[int]
    stats: Stats
    finish_reason: str  # "eos" | "length" | "stop" | "cancelled"
    # BatchGenerator.generate(keep_hidden=True): the target's last hidden states at every position of
    # prompt + answer but the last, [len(prompt_ids) + len(token_ids) - 1, dim]
    hidden_states: "torch.Tensor | None" = None
