"""The drafter chosen per sequence and step by measured payoff (method ``auto``).

A sequence holds every drafter available (prompt lookup always; suffix decoding; a draft model, heads, a
predicted output where given) and each step takes the one expected to give the most tokens per second,
or none (plain decoding). What decides, all measured on this machine and this sequence:

- the verify cost curve c(n): one target forward over n new tokens (hydraspec.verify_cost);
- each drafter's seconds per proposal (an average over its recent calls);
- each drafter's per-token acceptance a on this sequence: discounted counts (DECAY per observation) of
  drafts accepted and of proposals cut short by a rejection (the geometric model: a chain's i-th token is
  accepted with a^i), with every sequence's counts as the prior.

Drafters whose proposals cost next to nothing (``cheap``) propose every step, and where their proposal is
not verified it is still scored against the tokens decoded next (greedy: exactly what verification would
have accepted), so their estimates stay current at no cost. A drafter with a forward of its own is run only
when chosen; one not tried on a sequence for EXPLORE steps is tried once if its optimistic estimate could
beat the best. With R rows in the step a row's option is worth (R + expected extra tokens) / (c(R + its
nodes) + its drafting seconds), the batch's tokens per second if only this row drafted; plain decoding is
R / c(R). The output never depends on the choice: every proposal is verified by the target.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..tree import DraftTree, shape_of
from ..verify_cost import Curve
from .base import DecodeState, Drafter, RowStates, Verdict

DECAY = 0.9  # weight of older observations of a drafter on one sequence, per new observation
PRIOR_WEIGHT = 3.0  # the all-sequences estimate counts as this many observations of a sequence
EXPLORE = 16  # steps after which a drafter not tried on a sequence is tried once, if it could pay
MARGIN = 1.02  # a drafter must be expected to beat plain decoding by this


@dataclass
class Tally:
    """Discounted counts of one drafter's proposals: drafts accepted, and proposals cut short."""

    accepted: float = 0.0
    misses: float = 0.0

    def add(self, accepted: int, miss: int, decay: float = DECAY) -> None:
        self.accepted = self.accepted * decay + accepted
        self.misses = self.misses * decay + miss

    def rate(self, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        return (self.accepted + prior * weight) / (self.accepted + self.misses + weight)


@dataclass
class AutoRow:
    tallies: dict[str, Tally] = field(default_factory=dict)
    chosen: str | None = None  # the drafter whose proposal was verified last step
    tried: dict[str, int] = field(default_factory=dict)  # costly drafter -> steps since this sequence used it
    shadows: dict[str, tuple[int, list[int]]] = field(default_factory=dict)  # unverified cheap chains


class AutoDrafter(Drafter):
    """See the module docstring. ``drafters``: name -> Drafter; ``cost``: the target's verify cost curve
    (or a function returning it, called once at the first proposal)."""

    name = "auto"
    paced = True

    def __init__(self, drafters: dict[str, Drafter], cost):
        self.drafters = drafters
        self.cheap = {n: d for n, d in drafters.items() if d.cheap}
        self.costly = {n: d for n, d in drafters.items() if not d.cheap}
        self.max_nodes = max([d.max_nodes for d in drafters.values()] + [0])
        self.needs_hidden = any(d.needs_hidden for d in drafters.values())
        self._cost = cost
        self.totals = {n: Tally() for n in drafters}  # every sequence's counts, undiscounted
        self.seconds = {n: 0.0 for n in drafters}  # recent seconds per proposal of one row
        self.sizes = {n: 4.0 for n in drafters}  # recent nodes per proposal of the costly drafters
        self.rows: RowStates[AutoRow] = RowStates(lambda s: AutoRow())

    @property
    def cost(self) -> Curve:
        if not isinstance(self._cost, Curve):
            self._cost = Curve(self._cost() if callable(self._cost) else self._cost)
        return self._cost

    # -- proposing --------------------------------------------------------------------------------------
    def propose(self, states: list[DecodeState]) -> list[DraftTree]:
        rows = [self.rows.of(s) for s in states]
        for row, s in zip(rows, states):
            self._score_shadows(row, s)
        offers = {n: self._timed(n, states) for n in self.cheap}
        out = [DraftTree.empty() for _ in states]
        wants: dict[str, list[int]] = {n: [] for n in self.costly}
        for b, (row, s) in enumerate(zip(rows, states)):
            name, tree = self._choose(row, len(states), {n: t[b] for n, t in offers.items()})
            row.chosen, out[b] = name, tree
            if name in wants:
                wants[name].append(b)
            self._shadow(row, s, {n: t[b] for n, t in offers.items()}, name)
        for n, picked in wants.items():
            if picked:  # a first proposal also reads the prompt: not a proposal's usual cost
                first = any(n not in rows[b].tried for b in picked)
                for b, tree in zip(picked, self._timed(n, [states[b] for b in picked], record=not first)):
                    out[b] = tree
                    self.sizes[n] = 0.8 * self.sizes[n] + 0.2 * len(tree)
        for row in rows:
            for n in self.costly:
                if n == row.chosen:
                    row.tried[n] = 0
                elif n in row.tried:
                    row.tried[n] += 1
        return out

    def _timed(self, name: str, states: list[DecodeState], record: bool = True) -> list[DraftTree]:
        t0 = time.perf_counter()
        trees = self.drafters[name].propose(states)
        each = (time.perf_counter() - t0) / len(states)
        if record:
            self.seconds[name] = each if not self.seconds[name] else 0.8 * self.seconds[name] + 0.2 * each
        return trees

    def _choose(self, row: AutoRow, R: int, offers: dict[str, DraftTree]) -> tuple[str | None, DraftTree]:
        """The option with the most expected tokens per second of the batch (see the module docstring)."""
        c = self.cost
        best, pick, tree = R / c(R) * MARGIN, None, DraftTree.empty()
        for n, offer in offers.items():
            n_keep, value = self._best_cut(offer, self.rate(row, n), R, self.seconds[n])
            if value > best:
                best, pick, tree = value, n, offer.head(n_keep)
        for n in self.costly:
            a, size = self.rate(row, n), max(1, round(self.sizes[n]))
            value = (R + gain(a, size)) / (c(R + size) + self.seconds[n])
            if row.tried.get(n, EXPLORE) >= EXPLORE:
                opt = min(0.95, a + 0.2)
                if (R + gain(opt, size)) / (c(R + size) + self.seconds[n]) > best:
                    value = max(value, best * 1.0001)  # worth one try
            if value > best:
                best, pick, tree = value, n, DraftTree.empty()
        return pick, tree

    def _best_cut(self, offer: DraftTree, a: float, R: int, seconds: float) -> tuple[int, float]:
        """How many of the offer's first nodes to verify, and the batch's expected tokens per second."""
        if not len(offer):
            return 0, 0.0
        depth = shape_of(offer.with_root()).depth.tolist()[1:]
        c, best, keep, value = self.cost, 0.0, 0, float(R)
        for i, d in enumerate(depth):
            value += a ** (d + 1)
            v = value / (c(R + i + 1) + seconds)
            if v > best:
                best, keep = v, i + 1
        return keep, best

    def rate(self, row: AutoRow, name: str) -> float:
        prior = self.totals[name].rate(0.5, 2.0)
        tally = row.tallies.get(name)
        return min(0.99, tally.rate(prior) if tally is not None else prior)

    # -- learning -----------------------------------------------------------------------------------------
    def observe(self, states: list[DecodeState], verdicts: list[Verdict]) -> None:
        by: dict[str, tuple[list[DecodeState], list[Verdict]]] = {}
        for s, v in zip(states, verdicts):
            row = self.rows.get(s)
            if row is None or row.chosen is None:
                continue
            by.setdefault(row.chosen, ([], []))[0].append(s)
            by[row.chosen][1].append(v)
            if v.verified:
                self._count(row, row.chosen, len(v.accepted), int(len(v.accepted) < v.verified))
        for n, (ss, vs) in by.items():
            self.drafters[n].observe(ss, vs)

    def _count(self, row: AutoRow, name: str, accepted: int, miss: int) -> None:
        row.tallies.setdefault(name, Tally()).add(accepted, miss)
        self.totals[name].add(accepted, miss, decay=1.0)

    @staticmethod
    def _shadow(row: AutoRow, s: DecodeState, offers: dict[str, DraftTree], chosen: str | None) -> None:
        """Greedy rows: a cheap drafter's chain that is not verified is scored once the next tokens are known."""
        if not s.sampling.greedy:
            return
        for n, tree in offers.items():
            if n != chosen and len(tree) and n not in row.shadows and shape_of(tree.with_root()).is_chain:
                row.shadows[n] = (len(s.tokens), tree.tokens.tolist())

    def _score_shadows(self, row: AutoRow, s: DecodeState) -> None:
        for n, (at, tokens) in list(row.shadows.items()):
            seen = s.tokens[at:]
            m = 0
            while m < min(len(seen), len(tokens)) and seen[m] == tokens[m]:
                m += 1
            if m == len(tokens) or m < len(seen):
                self._count(row, n, m, int(m < len(tokens)))
                del row.shadows[n]


def gain(a: float, k: int) -> float:
    """Expected accepted tokens of a k-token chain whose i-th token is accepted with probability a^i."""
    return sum(a ** i for i in range(1, k + 1))
