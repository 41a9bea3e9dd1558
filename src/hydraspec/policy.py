"""How much of each row's draft a step verifies, and the acceptance statistics that decide it.

The engine asks a policy four things each step: :meth:`DraftPolicy.prefill` (how many prompt tokens joining
rows read beside the decoding rows), :meth:`DraftPolicy.limit` (before drafting: the most draft nodes a row
may propose at this number of rows; 0 = decode plainly), :meth:`DraftPolicy.cut` (after drafting: each row's
proposal cut to a BFS prefix) and :meth:`DraftPolicy.update` (after the step: what it cost and what each row
accepted). Cutting a draft only drops candidates: the output never changes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .drafters.base import DecodeState
from .packed_cost import PackedCost
from .tally import Tally, shadow_accepted
from .tree import DraftTree

PRIOR_RATE, PRIOR_WEIGHT = 0.5, 20.0
ROW_PRIOR_WEIGHT = 4.0
HEADROOM = 0.85  # LatencyCap: a step's fitted cost within this share of its bound


@dataclass
class RowStep:
    """What one row's step tells the policy."""

    key: int  # the sequence (DecodeState.key)
    tokens: list[int]  # its tokens after the step: prompt + answer
    depth: int  # depth of the verified draft tree (0: nothing drafted was verified)
    accepted: int  # drafted tokens accepted
    done: bool


@dataclass
class StepReport:
    """One engine step: ``rows`` running rows took ``seconds`` and emitted ``emitted`` tokens; ``drafted``:
    whether the drafter was asked (it paid for its proposals, however many the cut kept); ``tokens``: the new
    tokens its forward read (trees and prompt chunks); ``readers``: rows that only read a prompt chunk;
    ``joined``: decoding rows that read the rest of their prompt before their tree (their first step)."""

    rows: int
    drafted: bool
    seconds: float
    emitted: int
    row_steps: list[RowStep]
    tokens: int = 0
    readers: int = 0  # rows that read a prompt chunk in the same forward
    joined: int = 0  # decoding rows that also read the rest of their prompt in it


class AcceptanceBook:
    """Acceptance of drafts by depth (hydraspec.tally): over all rows from a prior of PRIOR_RATE worth
    PRIOR_WEIGHT draws at depth 1 (each deeper depth leaning on the one above), and per row with the overall
    rates as its prior (worth ROW_PRIOR_WEIGHT draws). A chain that the policy cut before verification is
    scored later against the tokens decoded since (a shadow): exactly so for greedy rows, as greedy
    verification accepts the drafts that equal the target's own next tokens."""

    def __init__(self):
        self.all = Tally()
        self.rows: dict[int, Tally] = {}  # key -> its own counts
        self.shadows: dict[int, tuple[int, list[int]]] = {}  # key -> (where it starts, its tokens)

    def rates(self) -> list[float]:
        return self.all.own_rates(PRIOR_RATE, PRIOR_WEIGHT)

    def rate(self) -> float:
        """The overall rate at depth 1."""
        return self.rates()[0]

    def row_rates(self, key: int) -> list[float]:
        row = self.rows.get(key)
        return self.rates() if row is None else row.rates(self.rates(), ROW_PRIOR_WEIGHT)

    def count(self, key: int, accepted: int, depth: int) -> None:
        self.all.add(accepted, depth)
        self.rows.setdefault(key, Tally()).add(accepted, depth)

    def shadow(self, key: int, at: int, tokens: list[int]) -> None:
        self.shadows.setdefault(key, (at, tokens))

    def update(self, steps: list[RowStep]) -> None:
        """Count each step's verified draft (a row with a shadow waiting is counted by the shadow instead)."""
        for s in steps:
            if s.depth and s.key not in self.shadows:
                self.count(s.key, s.accepted, s.depth)
        self.settle(steps)

    def settle(self, steps: list[RowStep]) -> None:
        """Score the shadows the steps' tokens decide and forget finished rows, counting nothing else (steps
        counted in another book)."""
        for s in steps:
            if s.key in self.shadows:
                self._score_shadow(s)
            if s.done:
                self.rows.pop(s.key, None)
                self.shadows.pop(s.key, None)

    def _score_shadow(self, s: RowStep) -> None:
        at, tokens = self.shadows[s.key]
        m = shadow_accepted(tokens, s.tokens[at:])
        if m is not None:
            self.count(s.key, m, len(tokens))
            del self.shadows[s.key]


class DraftPolicy:
    """The default policy: every proposal is verified whole, and a joining prompt is read ``chunk`` tokens a
    step."""

    def prefill(self, rows: int, chunk: int) -> int:
        """How many prompt tokens joining rows may read in a step beside ``rows`` decoding rows."""
        return chunk

    def limit(self, rows: int, extra: int = 0) -> int | None:
        """The most draft nodes a row may propose this step at ``rows`` rows beside ``extra`` prompt tokens
        read in the same forward (None: no limit; 0: none)."""
        return None

    def cut(self, trees: list[DraftTree], states: list[DecodeState], extra: int = 0) -> list[DraftTree]:
        """Each row's proposal as it will be verified (a BFS prefix of it)."""
        return trees

    def update(self, report: StepReport) -> None:
        """What the step cost and what each row accepted."""


class BudgetPolicy(DraftPolicy):
    """A cap on the tokens one verify forward holds over the whole batch: each row's draft is cut to
    max(1, budget // rows - 1) nodes."""

    def __init__(self, budget: int):
        self.budget = budget

    def limit(self, rows: int, extra: int = 0) -> int | None:
        return max(1, self.budget // rows - 1)


class LatencyCap(DraftPolicy):
    """A server's bound on every step: it may take at most ``ratio`` times a plain step of the rows that decode, so
    that no stream waits longer than that for its next tokens. What a step costs is fitted to the server's own
    steps (hydraspec.packed_cost: seconds by rows in the forward, new tokens and the kernels' passes over the
    weights, ``block`` rows a pass, from the measured one-row verify cost ``cost`` as the prior). The room
    beside one token a row is the most tokens that keep the fitted cost of the step, with a reading row beside
    the decoding ones, within HEADROOM times the bound (the fit is a mean and steps scatter around it). A
    joining prompt's chunk takes the room first (at least one token, so it always advances); the rows' drafts
    share what is left, on top of ``inner``'s rule. Cutting drafts and chunks changes when tokens come, never
    which."""

    def __init__(self, inner: DraftPolicy, cost: Callable[[float], float], ratio: float, block: int | None = None):
        self.inner, self.ratio = inner, ratio
        self.packed = PackedCost(cost, block)

    def plain(self, rows: int) -> float:
        """Fitted seconds of a plain step of ``rows`` decoding rows (one token each)."""
        return self.packed.cost(rows)(rows)

    def room(self, rows: int, alone: bool = False) -> int:
        """Tokens a step of ``rows`` decoding rows may hold beyond one per row; ``alone``: one row and no
        prompt chunk beside it, a one-row forward priced on the one-row curve (it runs compiled)."""
        r = max(rows, 1)
        if alone and r == 1:
            step = self.packed.forward(1)
            bound = HEADROOM * self.ratio * step(1)
        else:
            bound, step = HEADROOM * self.ratio * self.plain(r), self.packed.cost(r + 1)
        n = r
        while n < r + 4096 and step(n + 1) <= bound:
            n += 1
        return n - r

    def learn(self, rows: int, tokens: int, seconds: float) -> None:
        """A step whose forward held ``rows`` rows (decoding and reading) and ``tokens`` new tokens took
        ``seconds``."""
        self.packed.learn(rows, tokens, seconds)

    def prefill(self, rows: int, chunk: int) -> int:
        return min(self.inner.prefill(rows, chunk), max(1, self.room(rows)))

    def limit(self, rows: int, extra: int = 0) -> int | None:
        cap = max(0, self.room(rows, alone=not extra) - extra) // max(rows, 1)
        inner = self.inner.limit(rows, extra)
        return cap if inner is None else min(inner, cap)

    def cut(self, trees: list[DraftTree], states: list[DecodeState], extra: int = 0) -> list[DraftTree]:
        return self.inner.cut(trees, states, extra)

    def update(self, report: StepReport) -> None:
        self.learn(report.rows + report.readers, report.tokens, report.seconds)
        self.inner.update(report)
