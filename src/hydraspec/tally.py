"""Acceptance of drafts counted by depth, for the rules that decide how many drafts to verify (the per-row
policy, hydraspec.adaptive, and the per-request choice, hydraspec.drafters.auto).

r_d is the chance that a draft at depth d is accepted once the one above it was; a draft at depth d is worth
r_1 ... r_d accepted tokens. One rate for every depth (a^d, the geometric model of Leviathan et al. 2023) is
the special case r_d = a: it cuts the deep drafts of a long match (a repeated answer, a copied span) that are
accepted whole far more often than a^d says.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DEPTHS = 32  # depths counted apart; deeper drafts share the last depth's counts


@dataclass
class Tally:
    """Counts of proposals by depth, each older observation weighted by ``decay`` per new one: drafts that
    reached depth d (the one above accepted) and drafts accepted there."""

    reached: list[float] = field(default_factory=lambda: [0.0] * DEPTHS)
    accepted: list[float] = field(default_factory=lambda: [0.0] * DEPTHS)
    # own_rates as last computed, by (start, weight); emptied by add (a rule asks them several times a step)
    known: dict = field(default_factory=dict, repr=False, compare=False)

    def add(self, accepted: int, depth: int, decay: float = 1.0) -> None:
        """One proposal of ``depth`` levels verified, ``accepted`` of them accepted along its path."""
        self.known.clear()
        if decay != 1.0:
            self.reached = [x * decay for x in self.reached]
            self.accepted = [x * decay for x in self.accepted]
        for d in range(min(accepted + 1, depth)):
            k = min(d, DEPTHS - 1)
            self.reached[k] += 1
            self.accepted[k] += d < accepted

    def rates(self, prior: list[float], weight: float) -> list[float]:
        """r_d per depth, each pulled towards ``prior[d]`` as if seen ``weight`` times."""
        return [(a + p * weight) / (n + weight) for a, n, p in zip(self.accepted, self.reached, prior)]

    def own_rates(self, start: float = 0.5, weight: float = 2.0) -> list[float]:
        """r_d per depth with no outside prior: depth 1 leans on ``start``, each deeper one on the one above."""
        out = self.known.get((start, weight))
        if out is None:
            out, prev = [], start
            for a, n in zip(self.accepted, self.reached):
                prev = (a + prev * weight) / (n + weight)
                out.append(prev)
            self.known[start, weight] = out
        return list(out)


@dataclass
class Calibration:
    """Realised over predicted acceptance by depth, over the drafts a rule chose to verify: the chances it
    predicted for them (discounted sums) and how many were accepted. Choosing the drafts whose estimates are
    highest picks the ones most overestimated (the winner's curse); :meth:`factors` scales the estimates
    back to what such choices realised."""

    predicted: list[float] = field(default_factory=lambda: [0.0] * DEPTHS)
    realised: list[float] = field(default_factory=lambda: [0.0] * DEPTHS)

    def add(self, depths: list[int], chances: list[float], hits: list[bool], decay: float) -> None:
        """One verified proposal: each node's depth (1-based), predicted chance, and whether it was accepted."""
        self.predicted = [x * decay for x in self.predicted]
        self.realised = [x * decay for x in self.realised]
        for d, p, hit in zip(depths, chances, hits):
            k = min(d, DEPTHS) - 1
            self.predicted[k] += p
            self.realised[k] += hit

    def factors(self, weight: float) -> list[float]:
        """Per depth, realised over predicted, each as if ``weight`` more were predicted and realised."""
        return [(r + weight) / (p + weight) for r, p in zip(self.realised, self.predicted)]


def reach(rates: list[float], nodes: int) -> list[float]:
    """The chance that a draft at each depth 1..nodes is accepted: the product of the rates down to it."""
    out, p = [], 1.0
    for d in range(nodes):
        p *= rates[min(d, len(rates) - 1)]
        out.append(p)
    return out


def shadow_accepted(tokens: list[int], seen: list[int]) -> int | None:
    """How many of an unverified chain's ``tokens`` greedy verification would have accepted, given the tokens
    ``seen`` decoded since it was proposed (they equal the target's own), or None while that is not yet
    known (every token seen so far matched and the chain goes on)."""
    m = 0
    while m < min(len(seen), len(tokens)) and seen[m] == tokens[m]:
        m += 1
    return m if m == len(tokens) or m < len(seen) else None
