"""Turning logits into the distribution tokens are drawn from; the same warping for target and draft."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def _nucleus(self, sorted_x: torch.Tensor) -> torch.Tensor:
        """Logits sorted in descending order with the tokens outside the top-p nucleus set to -inf: a token
        goes when the mass before it already reaches top_p (the first token always stays)."""
        p = sorted_x.softmax(-1)
        return sorted_x.masked_fill((p.cumsum(-1) - p) >= self.top_p, float("-inf"))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., vocab] float logits -> [..., vocab] probabilities after temperature, top-k, top-p."""
        x = logits.float() / self.temperature
        if self.top_k and self.top_k < x.shape[-1]:
            top = torch.topk(x, self.top_k, dim=-1)  # sorted: top-p needs no sort of the whole vocabulary
            vals = self._nucleus(top.values) if self.top_p < 1.0 else top.values
            return torch.full_like(x, float("-inf")).scatter(-1, top.indices, vals).softmax(-1)
        if self.top_p < 1.0:
            sorted_x, order = torch.sort(x, dim=-1, descending=True)
            x = torch.empty_like(x).scatter(-1, order, self._nucleus(sorted_x))
        return x.softmax(-1)


def sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn from the probabilities ``p`` [vocab] (not necessarily normalised): the first index
    whose cumulative mass reaches u * total, u uniform in (0, 1], so a token of probability 0 is never
    drawn. A cumulative sum and a binary search: torch.multinomial costs 30x more on a 150k vocabulary."""
    c = p.float().cumsum(-1)
    u = (1.0 - torch.rand((), generator=generator)) * c[-1]
    return min(int(torch.searchsorted(c, u.reshape(1))), p.numel() - 1)


def sample_without_replacement(p: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """k distinct tokens drawn one after another from p, each time excluding those already drawn."""
    k = min(k, int((p > 0).sum().item()))
    q = p.float().clone()
    out = []
    for _ in range(k):
        t = sample(q, generator)
        out.append(t)
        q[t] = 0.0
    return torch.tensor(out, dtype=torch.long)
