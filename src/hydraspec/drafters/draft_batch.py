"""Draft-model chains for many rows at once: the batched form of DraftModelDrafter's chain mode
(speculative decoding with a draft model, Leviathan et al. 2023).

One draft cache of B rows, laid out like the engine's target cache: row b's content at slots
[0, length_b), a masked gap up to the shared write pointer, new tokens written there and moved next to
the row's prefix. One draft forward per depth serves every row still drafting.

Guarantee: each row proposes exactly what the single-sequence drafter would (same tokens, same q, same
draws from the row's own generator): its own dynamic length (:func:`next_length`), the greedy confidence
stop (per token or along the path), and after verification the draft cache keeps only the accepted drafts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import allocate_rows, compact, new_cache, prefill_rows, select_rows, set_length, use_rows
from ..sampling import sample_without_replacement
from ..tree import DraftTree, chain
from ..verify import ragged_mask
from .base import DecodeState, next_length


@dataclass
class DraftRow:
    """One row's place in the draft cache."""

    length: int  # the row's draft-cache length
    cached: int  # tokens of state.tokens in the draft cache
    k: int  # current draft length
    fed: int = 0  # draft tokens fed during the last proposal


class DraftBatch:
    """The batched chain of a DraftModelDrafter ``proto`` (its model and settings) for up to ``rows_max``
    rows of ``capacity`` draft-cache slots. Rows are indexed as the caller's: :meth:`add` appends,
    :meth:`keep` drops, :meth:`propose` takes one DecodeState per row in that order."""

    def __init__(self, proto, capacity: int, rows_max: int):
        self.p, self.model = proto, proto.model
        self.cache = new_cache(self.model, capacity)
        allocate_rows(self.cache, self.model, rows_max)
        self.rows: list[DraftRow] = []

    def add(self, first: int, states: list[DecodeState]) -> None:
        """New rows at [first, first + len(states)): prefill the draft model on their tokens but the last
        (the pending token, which the next proposal feeds)."""
        assert first == len(self.rows), "rows join at the end"
        new = [DraftRow(length=len(s.tokens) - 1, cached=len(s.tokens) - 1, k=self.p.k0) for s in states]
        if any(r.cached for r in new):
            prefill_rows(self.model, self.cache, first, [s.tokens[:-1] for s in states])
        self.rows.extend(new)
        use_rows(self.cache, 0, len(self.rows))

    def keep(self, keep: list[int]) -> None:
        """Only rows ``keep`` (ascending indices) stay, in that order."""
        self.rows[:] = [self.rows[b] for b in keep]
        select_rows(self.cache, torch.tensor(keep, dtype=torch.long, device=self.model.device))

    def _forward(self, feeds: list[list[int]]) -> torch.Tensor:
        """Append feeds[b] to row b's draft cache; logits [B, vocab] at each row's last fed token."""
        rows, dev = self.rows, self.model.device
        B, C = len(rows), max(1, max(len(f) for f in feeds))
        W = max(r.length for r in rows)
        ids = torch.zeros(B, C, dtype=torch.long)
        pos = torch.empty(B, C, dtype=torch.long)
        tree_allowed = torch.eye(C, dtype=torch.bool).repeat(B, 1, 1)
        src = torch.full((B, C), W + C - 1, dtype=torch.long)
        dst = torch.full((B, C), W + C - 1, dtype=torch.long)
        for b, (r, f) in enumerate(zip(rows, feeds)):
            c = len(f)
            pos[b] = r.length + torch.arange(C).clamp(max=max(c - 1, 0))
            if c:
                ids[b, :c] = torch.tensor(f)
                tree_allowed[b, :c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
                src[b, :c] = W + torch.arange(c)
                dst[b, :c] = r.length + torch.arange(c)
        set_length(self.cache, W)
        mask = ragged_mask([r.length for r in rows], W, tree_allowed, self.model.dtype, dev)
        out = self.model(input_ids=ids.to(dev), position_ids=pos.to(dev), attention_mask=mask,
                         past_key_values=self.cache, use_cache=True)
        last = torch.tensor([max(len(f) - 1, 0) for f in feeds], device=out.logits.device)
        logits = out.logits[torch.arange(B, device=last.device), last].float()
        compact(self.cache, src.to(dev), dst.to(dev))
        for r, f in zip(rows, feeds):
            r.length += len(f)
        return logits

    @torch.inference_mode()
    def propose(self, states: list[DecodeState]) -> list[DraftTree]:
        """One chain per row (row b of the batch decodes states[b])."""
        p, rows = self.p, self.rows
        assert len(states) == len(rows)
        logits = self._forward([s.tokens[r.cached:] for r, s in zip(rows, states)])
        for r, s in zip(rows, states):
            r.cached, r.fed = len(s.tokens), 0
        toks: list[list[int]] = [[] for _ in rows]
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        drafting = [True] * len(rows)
        reach = [0.0] * len(rows)  # path stop: log of each row's chain probability under the draft
        for depth in range(max(r.k for r in rows)):
            for b, (r, s) in enumerate(zip(rows, states)):
                if not drafting[b] or depth >= r.k:
                    drafting[b] = False
                    continue
                lg = logits[b]
                if s.sampling.greedy:
                    top = torch.topk(lg, 1)
                    if p.confidence > 0:
                        lp = top.values[0].item() - torch.logsumexp(lg, -1).item()
                        if p.stop == "path":
                            reach[b] += lp
                            lp = reach[b]
                        if toks[b] and lp < p.log_confidence:
                            drafting[b] = False
                            continue
                    toks[b].append(int(top.indices[0]))
                else:
                    probs = s.sampling.probs(lg)
                    toks[b].append(int(sample_without_replacement(probs, 1, s.generator)[0]))
                    qs[b].append(probs)
                if depth >= r.k - 1:  # the last draft of a chain is not fed
                    drafting[b] = False
            if not any(drafting):
                break
            feeds = [[toks[b][-1]] if drafting[b] else [] for b in range(len(rows))]
            logits = self._forward(feeds)
            for r, f in zip(rows, feeds):
                r.fed += len(f)
        return [DraftTree(torch.tensor(t, dtype=torch.long), chain(len(t)), torch.stack(q) if q else None)
                for t, q in zip(toks, qs)]

    def observe(self, b: int, n_accepted: int) -> None:
        """Row b's verdict: the first ``n_accepted`` drafts of its last chain were accepted."""
        r = self.rows[b]
        r.cached += min(n_accepted, r.fed)  # accepted drafts already in the draft cache stay, the rest go
        r.length = r.cached
        if self.p.dynamic:
            r.k = next_length(r.k, n_accepted, r.k, self.p.max_k)
