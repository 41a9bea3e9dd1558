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
from .tally import Tally, shadow_accepted
from .tree import DraftTree

PRIOR_RATE, PRIOR_WEIGHT = 0.5, 20.0
ROW_PRIOR_WEIGHT = 4.0


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
    tokens its forward read (trees and prompt chunks)."""

    rows: int
    drafted: bool
    seconds: float
    emitted: int
    row_steps: list[RowStep]
    tokens: int = 0


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
        for s in steps:
            if s.key in self.shadows:
                self._score_shadow(s)
            elif s.depth:
                self.count(s.key, s.accepted, s.depth)
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
    """A server's bound on every step: it may take at most ``ratio`` times a plain step of the rows that
    decode, so that no stream waits longer than that for its next tokens. The room beside one token a row
    starts from the measured verify cost ``cost`` (seconds by tokens: c(T) <= ratio * c(rows)) and then
    follows the steps' own times, as a step with prompt chunks and several rows can cost more than the
    one-row curve says: a step over the bound shrinks its row count's room by a quarter, one well within it
    grows the room by a token (plain steps, one token a row, set what a plain step takes). A joining prompt's
    chunk takes the room first (at least one token, so it always advances); the rows' drafts share what is
    left, on top of ``inner``'s rule. Cutting drafts and chunks changes when tokens come, never which."""

    def __init__(self, inner: DraftPolicy, cost: Callable[[float], float], ratio: float):
        self.inner, self.cost, self.ratio = inner, cost, ratio
        self.rooms: dict[int, int] = {}
        self.plain: dict[int, float] = {}  # rows -> recent seconds of a plain step

    def room(self, rows: int) -> int:
        """Tokens a step of ``rows`` decoding rows may hold beyond one per row."""
        if rows not in self.rooms:
            n, bound = max(rows, 1), self.ratio * self.cost(max(rows, 1))
            while n < rows + 4096 and self.cost(n + 1) <= bound:
                n += 1
            self.rooms[rows] = n - rows
        return self.rooms[rows]

    def learn(self, rows: int, tokens: int, seconds: float) -> None:
        """A step of ``rows`` decoding rows that read ``tokens`` new tokens took ``seconds``."""
        if rows < 1 or tokens < rows:
            return
        if tokens == rows:
            old = self.plain.get(rows)
            self.plain[rows] = seconds if old is None else 0.9 * old + 0.1 * seconds
            return
        bound = self.ratio * self.plain.get(rows, self.cost(rows))
        room = self.room(rows)
        if seconds > bound:
            self.rooms[rows] = max(1, int(room * 0.75))
        elif seconds < 0.8 * bound and tokens - rows >= room:
            self.rooms[rows] = room + 1

    def prefill(self, rows: int, chunk: int) -> int:
        return min(self.inner.prefill(rows, chunk), max(1, self.room(rows)))

    def limit(self, rows: int, extra: int = 0) -> int | None:
        cap = max(0, self.room(rows) - extra) // max(rows, 1)
        inner = self.inner.limit(rows, extra)
        return cap if inner is None else min(inner, cap)

    def cut(self, trees: list[DraftTree], states: list[DecodeState], extra: int = 0) -> list[DraftTree]:
        return self.inner.cut(trees, states, extra)

    def update(self, report: StepReport) -> None:
        self.learn(report.rows, report.tokens, report.seconds)
        self.inner.update(report)
