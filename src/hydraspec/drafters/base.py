from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..sampling import Sampling
from ..tree import DraftTree


@dataclass
class DecodeState:
    """What a drafter may look at. tokens[-1] is the pending token: chosen by the target, not yet in
    its cache; hidden is the target's last hidden state that produced it (only if the drafter asks)."""

    tokens: list[int]
    prompt_len: int
    sampling: Sampling
    generator: torch.Generator | None = None
    hidden: torch.Tensor | None = None  # [dim]
    # hidden states [m, dim] of the tokens the target committed to its cache since the last proposal
    # (the prompt after prefill; then the pending token and the accepted drafts); hidden == new_hidden[-1]
    new_hidden: torch.Tensor | None = None


class Drafter:
    """Proposes a DraftTree under the pending token, then learns which of its nodes were accepted."""

    name = "ar"
    needs_hidden = False
    max_nodes = 0  # upper bound on the size of any proposed tree
    cheap = False  # proposing costs next to nothing (no model forward): a load rule may let it always propose

    def fork(self) -> "Drafter":
        """A drafter for one more sequence decoded beside this one: models, heads and settings shared,
        per-sequence state (caches, adaptive lengths) its own once :meth:`start` runs. Drafters that hold
        other drafters fork those too."""
        return copy.copy(self)

    def start(self, state: DecodeState, capacity: int) -> None:
        """A new generation begins; `capacity` is the longest the sequence can get."""

    def propose(self, state: DecodeState) -> DraftTree:
        return DraftTree.empty()

    def propose_batch(self, states: list[DecodeState], row_drafters: list["Drafter"] | None = None):
        """One proposal per row in one pass (a drafter that can share work across rows does it here), or
        None: then each row's own drafter is asked with :meth:`propose`."""
        return None

    def batch_state(self, capacity: int, rows_max: int):
        """For a drafter whose batched work needs state of its own across steps (a draft model's B-row
        cache): an object with ``add(first, states)``, ``propose(states)``, ``observe(b, n_accepted)`` and
        ``keep(rows)`` that drafts for every row in place of the rows' own drafters. None (the default):
        rows draft with their own drafters, through :meth:`propose_batch` or :meth:`propose`."""
        return None

    def observe(self, state: DecodeState, accepted: list[int]) -> None:
        """accepted: indices into the last proposed DraftTree along the accepted path, in order."""

    def cut(self, n: int) -> None:
        """Only the first ``n`` nodes of the last proposal were verified (a load rule cut the rest), so
        :meth:`observe` will judge those."""


def next_length(k: int, n_accepted: int, target: int, k_max: int) -> int:
    """The dynamic draft length of transformers' assisted generation: +2 (at most k_max) after a step
    that accepted all ``target`` drafts, -1 (at least 1) otherwise."""
    return min(k + 2, k_max) if n_accepted >= target else max(1, k - 1)


class NoDrafter(Drafter):
    """Plain autoregressive decoding through the same engine: every tree is just the pending token."""
