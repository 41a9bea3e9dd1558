"""Draft-model chains for many rows at once: the batched form of DraftModelDrafter's chain mode
(speculative decoding with a draft model, Leviathan et al. 2023).

One draft cache of B rows, laid out like the engine's target cache: row b's content at slots
[0, length_b), a masked gap up to the shared write pointer, new tokens written there and moved next to
the row's prefix. One draft forward per depth serves every row still drafting.

Guarantee: each row proposes exactly what it would decoded alone (same tokens, same q, same draws from
the row's own generator): its own dynamic length (:func:`next_length`), the greedy confidence
stop (per token or along the path), and after verification the draft cache keeps only the accepted drafts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import (allocate_rows, cache_kwargs, compact, copy_rows, fill_holes, new_cache, prefill_rows, select_rows,
                     set_length, use_rows)
from ..draft_vocab import greedy_tops, kept_ids_of
from ..sampling import sample_without_replacement
from ..tree import DraftTree, chain
from ..verify import ragged_mask, ragged_positions, with_window
from .base import DecodeState, Verdict, capacity_of, next_length


@dataclass
class DraftRow:
    """One sequence's place in the draft cache."""

    state: DecodeState
    length: int  # the row's draft-cache length
    cached: int  # tokens of state.tokens in the draft cache
    k: int  # current draft length
    fed: int = 0  # draft tokens fed during the last proposal


class DraftBatch:
    """The batched chain of a DraftModelDrafter ``proto`` (its model and settings). Its cache rows follow
    the sequences it is asked about: a new sequence joins at the end (prefilled on its prompt), one that is
    done leaves, and the cache grows (rows or slots) when a sequence needs more than it holds."""

    def __init__(self, proto):
        self.p, self.model = proto, proto.model
        self.keep = kept_ids_of(self.model)  # a cut output layer's ids: greedy picks look at those only
        self.cache = None
        self.rows: list[DraftRow] = []
        self.index: dict[int, int] = {}  # sequence key -> row
        self.size = (0, 0)  # allocated rows, slots

    def _sync(self, states: list[DecodeState]) -> None:
        """Rows of finished sequences leave, rows for new ones join."""
        gone = [b for b, r in enumerate(self.rows) if r.state.done]
        if gone:
            keep = fill_holes(len(self.rows), gone)
            self.rows[:] = [self.rows[b] for b in keep]
            select_rows(self.cache, keep, [r.length for r in self.rows])
        new = [s for s in states if s.key not in {r.state.key for r in self.rows}]
        if new:
            self._reserve(len(self.rows) + len(new), max(capacity_of(s) for s in new) + self.p.max_nodes + 1)
            first = len(self.rows)
            self.rows.extend(DraftRow(s, len(s.tokens) - 1, len(s.tokens) - 1, self.p.k0) for s in new)
            if any(len(s.tokens) > 1 for s in new):
                prefill_rows(self.model, self.cache, first, [s.tokens[:-1] for s in new])
            use_rows(self.cache, 0, len(self.rows))
        if gone or new:
            self.index = {r.state.key: b for b, r in enumerate(self.rows)}

    def _reserve(self, rows: int, slots: int) -> None:
        """Room for ``rows`` rows of ``slots`` slots (allocated anew, holding what the old cache held)."""
        if rows <= self.size[0] and slots <= self.size[1]:
            return
        size = (max(rows, 2 * self.size[0]), max(slots, self.size[1]))
        cache = new_cache(self.model, size[1])
        allocate_rows(cache, self.model, size[0])
        if self.cache is not None:
            copy_rows(self.cache, cache, len(self.rows))
        self.cache, self.size = cache, size

    def _forward(self, feeds: list[list[int]]) -> torch.Tensor:
        """Append feeds[b] to row b's draft cache; logits [B, vocab] at each row's last fed token (in the
        model's dtype)."""
        rows, dev = self.rows, self.model.device
        if len(rows) == 1 and feeds[0]:
            return self._forward_one(feeds[0])
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
        lengths = [r.length for r in rows]
        mask = ragged_mask(lengths, W, tree_allowed, self.model.dtype, dev)
        mask = with_window(self.model, mask, lambda: (pos, ragged_positions(lengths, W, pos)))
        out = self.model(input_ids=ids.to(dev), position_ids=pos.to(dev), attention_mask=mask,
                         use_cache=True, **cache_kwargs(self.model, self.cache))
        last = torch.tensor([max(len(f) - 1, 0) for f in feeds], device=out.logits.device)
        logits = out.logits[torch.arange(B, device=last.device), last]
        compact(self.cache, src.to(dev), dst.to(dev))
        for r, f in zip(rows, feeds):
            r.length += len(f)
        return logits

    def _forward_one(self, feed: list[int]) -> torch.Tensor:
        """_forward for a cache of one row: its tokens end at the write pointer, so the feed is a plain causal
        step with no mask to build and nothing to move."""
        r, dev = self.rows[0], self.model.device
        set_length(self.cache, r.length)
        out = self.model(input_ids=torch.tensor([feed], device=dev), use_cache=True, logits_to_keep=1,
                         position_ids=torch.arange(r.length, r.length + len(feed), device=dev)[None],
                         **cache_kwargs(self.model, self.cache))
        r.length += len(feed)
        return out.logits[:, -1]

    @torch.inference_mode()
    def propose(self, states: list[DecodeState]) -> list[DraftTree]:
        """One chain per sequence of ``states`` (cache rows of other sequences only wait)."""
        p = self.p
        self._sync(states)
        at = [self.index[s.key] for s in states]
        rows = [self.rows[b] for b in at]
        feeds = [[] for _ in self.rows]
        for b, s in zip(at, states):
            feeds[b] = s.tokens[self.rows[b].cached:]
        logits = self._forward(feeds)[at]
        for r, s in zip(rows, states):
            r.cached, r.fed = len(s.tokens), 0
        toks: list[list[int]] = [[] for _ in rows]
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        drafting = [True] * len(rows)
        reach = [0.0] * len(rows)  # path stop: log of each row's chain probability under the draft
        greedy = any(s.sampling.greedy for s in states)
        for depth in range(max(r.k for r in rows)):
            tops, lps = greedy_tops(logits, self.keep) if greedy else ([], [])
            for b, (r, s) in enumerate(zip(rows, states)):
                if not drafting[b] or depth >= r.k:
                    drafting[b] = False
                    continue
                if s.sampling.greedy:
                    if p.confidence > 0:
                        lp = lps[b]
                        if p.stop == "path":
                            reach[b] += lp
                            lp = reach[b]
                        if toks[b] and lp < p.log_confidence:
                            drafting[b] = False
                            continue
                    toks[b].append(tops[b])
                else:
                    probs = s.sampling.probs(logits[b].float())
                    toks[b].append(int(sample_without_replacement(probs, 1, s.generator)[0]))
                    qs[b].append(probs)
                if depth >= r.k - 1:  # the last draft of a chain is not fed
                    drafting[b] = False
            if not any(drafting):
                break
            feeds = [[] for _ in self.rows]
            for b, j in enumerate(at):
                if drafting[b]:
                    feeds[j] = [toks[b][-1]]
                    rows[b].fed += 1
            logits = self._forward(feeds)[at]
        return [DraftTree(torch.tensor(t, dtype=torch.long), chain(len(t)), torch.stack(q) if q else None)
                for t, q in zip(toks, qs)]

    def observe(self, states: list[DecodeState], verdicts: list[Verdict]) -> None:
        """The first len(accepted) drafts of each sequence's last chain were accepted."""
        for s, v in zip(states, verdicts):
            r = self.rows[self.index[s.key]]
            n = len(v.accepted)
            r.cached += min(n, r.fed)  # accepted drafts already in the draft cache stay, the rest go
            r.length = r.cached
            if self.p.dynamic:
                r.k = next_length(r.k, n, r.k, self.p.max_k)
