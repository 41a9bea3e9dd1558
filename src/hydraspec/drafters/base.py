"""What every drafter is: two methods, as transformers' candidate generator has (get candidates, then learn
how many were accepted), over all running sequences at once.

``propose(states) -> trees`` drafts a token tree under each sequence's pending token; ``observe(states,
verdicts)`` tells the drafter which of those nodes the target verified and accepted. A drafter keeps its
per-sequence state itself (:class:`RowStates`: made at a sequence's first proposal, dropped once the
sequence is done), and work it can share across sequences (a draft model's batch cache) stays private to it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

import torch

from ..sampling import Sampling
from ..tree import DraftTree

_KEYS = itertools.count()


@dataclass(eq=False)
class DecodeState:
    """One sequence as a drafter may see it. tokens[-1] is the pending token: chosen by the target, not yet
    in its cache; hidden is the target's last hidden state that produced it (only if the drafter asks).
    ``key`` names the sequence for a drafter's per-sequence state; ``done`` is set once it has left."""

    tokens: list[int]  # prompt + answer so far
    prompt_len: int
    sampling: Sampling
    generator: torch.Generator | None = None
    hidden: torch.Tensor | None = None  # [dim]
    # hidden states [m, dim] of the tokens the target committed to its cache since the last proposal
    # (the prompt after prefill; then the pending token and the accepted drafts); hidden == new_hidden[-1]
    new_hidden: torch.Tensor | None = None
    capacity: int = 0  # the longest the sequence can get (prompt + budget + a tree)
    prediction: list[int] | None = None  # token ids the caller expects the answer to mostly repeat
    counters: dict[str, int] = field(default_factory=dict)  # drafters' counts for the result (usage)
    key: int = field(default_factory=lambda: next(_KEYS))
    done: bool = False


@dataclass
class Verdict:
    """How one proposal fared: ``accepted`` its node indices along the accepted path, in order; ``verified``
    how many of its first nodes the target saw (a load rule may cut a proposal before verification)."""

    accepted: list[int]
    verified: int


class Drafter:
    """Proposes a DraftTree under each sequence's pending token, then learns which nodes were accepted.

    name: the method's name. max_nodes: an upper bound on the size of any proposed tree. needs_hidden: the
    drafter reads the target's hidden states (DecodeState.hidden / new_hidden). cheap: proposing costs next
    to nothing (no model forward), so a load rule may let it always propose. paced: it sizes its proposals
    by their measured cost itself, so no load rule cuts them. beside: prompt tokens that joining rows read in
    the same forward as the proposals (set by the engine before each ``propose``; a paced drafter counts them
    in the step's cost); readers: the rows among them that only read (do not decode). limit: the most nodes a
    row's proposal keeps this step (set by the engine with ``beside``; None: no limit), what a paced drafter
    weighs its choices on. follows: cheap only because it is asked every step (a head that reads every
    committed token): its proposal is paid every step, so a chooser may leave it out of a sequence where that
    costs more than it adds."""

    name = "ar"
    needs_hidden = False
    max_nodes = 0
    cheap = False
    follows = False
    paced = False
    beside = 0
    readers = 0
    limit: int | None = None

    def propose(self, states: list[DecodeState]) -> list[DraftTree]:
        return [DraftTree.empty() for _ in states]

    def observe(self, states: list[DecodeState], verdicts: list[Verdict]) -> None:
        """verdicts[b]: how the last proposal for states[b] fared."""

    def forget(self) -> None:
        """Drop what finished sequences left for later ones (earlier answers); sequences in flight keep theirs."""

    @property
    def reused(self) -> int:
        """Tokens a drafter with a model of its own has taken from earlier sequences instead of reading them (a
        running count; a paced drafter's catch-up costs only what it read)."""
        return 0

    def known(self, state: DecodeState) -> int:
        """Of a sequence this drafter has not started on, the first tokens it would take from earlier sequences
        instead of reading them (a paced drafter's estimate of a first try's cost; it asks once a sequence)."""
        return 0

    def step_took(self, rows: int, tokens: int, seconds: float) -> None:
        """The step's forward over ``rows`` rows (decoding and reading) and ``tokens`` new tokens took
        ``seconds`` (a paced drafter learns its cost)."""


class NoDrafter(Drafter):
    """Plain autoregressive decoding through the same engine: every tree is just the pending token."""


R = TypeVar("R")


class RowStates(Generic[R]):
    """A drafter's per-sequence state: ``of(state)`` makes it with ``make(state)`` at a sequence's first
    proposal; entries of sequences that are done go at the next :meth:`of`'s sweep, each handed to
    ``gone(state, entry)`` first where given."""

    def __init__(self, make: Callable[[DecodeState], R], gone: Callable[[DecodeState, R], None] | None = None):
        self.make, self.gone = make, gone
        self.rows: dict[int, tuple[DecodeState, R]] = {}

    def of(self, state: DecodeState) -> R:
        got = self.rows.get(state.key)
        if got is None:
            self.sweep()
            got = self.rows[state.key] = (state, self.make(state))
        return got[1]

    def sweep(self) -> None:
        for key in [k for k, (s, _) in self.rows.items() if s.done]:
            state, entry = self.rows.pop(key)
            if self.gone is not None:
                self.gone(state, entry)

    def get(self, state: DecodeState) -> R | None:
        got = self.rows.get(state.key)
        return None if got is None else got[1]


def capacity_of(state: DecodeState) -> int:
    """The cache slots a sequence may need (the engine says; a caller that does not gets room for 512 more)."""
    return state.capacity or len(state.tokens) + 512


def next_length(k: int, n_accepted: int, target: int, k_max: int) -> int:
    """The dynamic draft length of transformers' assisted generation: +2 (at most k_max) after a step
    that accepted all ``target`` drafts, -1 (at least 1) otherwise."""
    return min(k + 2, k_max) if n_accepted >= target else max(1, k - 1)
