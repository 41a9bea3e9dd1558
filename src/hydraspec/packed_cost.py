"""What a packed step of several rows costs, learnt from the steps' own times.

The verify cost curve (hydraspec.verify_cost) is measured on one row, and on a CPU a one-row forward of up to
16 tokens runs compiled. A step of several rows (or one row beside a prompt chunk) goes through the model
packed, eagerly, with attention over several caches: it costs more, and its cost grows with every token,
where the compiled curve is nearly flat over some sizes. A drafter that weighs cost against acceptance on
the one-row curve would then verify drafts in a batch that cost more than they give.

:class:`PackedCost` fits seconds = a + b * tokens + c * (rows - 1) + d * (passes - 1) by least squares over the
recent packed steps (each older step weighing FORGET times the next), from a prior of the one-row curve's points
worth PRIOR steps in all. The prior fades with the steps, but for a share KEEP of the points and a pull of the
rows term towards 0 and of the passes term towards the curve's own jumps: steps that all hold two rows cannot
tell the rows term from the constant, nor steps that stay within one block the passes term, and without a prior
that stays their fit would be any split of the two (a long-lived server's fit did go that way, and a joining
prompt read 13 tokens a step beside one decoding row). ``passes`` is how many times the kernels go through each
weight for that many tokens (they take activation rows in blocks, hydraspec.backend.rows_per_pass): the first
token of a new block costs a pass over the weights, the next ones little, so a straight line in the tokens
under-prices the step just past a block and over-prices the one that fills it. Until steps are seen it is the
curve; then it follows the machine.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

FORGET = 0.98  # weight of a step relative to the one after it (about the last 50 steps count)
PRIOR = 2.0  # the one-row curve's points count as this many steps in all
PRIOR_SIZES = (2, 4, 6, 7, 8, 12, 13, 16)
KEEP = 0.05  # share of the curve's points that never fades
MIN_SLOPE = 0.2  # the slope is kept at least this share of the curve's own average slope


class PackedCost:
    """Seconds of a packed step by rows and new tokens: ``cost(rows)`` gives the curve T -> seconds for that
    many rows; :meth:`learn` takes each step's measured forward."""

    def __init__(self, curve: Callable[[float], float], block: int | None = None):
        self.curve, self.block = curve, block
        xs = np.array([self._x(1, t) for t in PRIOR_SIZES])
        ys = np.array([curve(t) for t in PRIOR_SIZES])
        w = PRIOR / len(PRIOR_SIZES)
        self.xtx, self.xty = w * xs.T @ xs, w * xs.T @ ys  # the curve's points: they fade with the steps
        # what never fades: a share KEEP of the curve's points, and the rows term at 0 (the curve has one row)
        # and the passes term at the curve's own jumps, each as strong as the whole prior
        jumps = np.linalg.lstsq(xs[:, [0, 1, 3]], ys, rcond=None)[0][2] if block else 0.0
        self.kept = (KEEP * self.xtx + np.diag([0.0, 0.0, PRIOR, PRIOR]),
                     KEEP * self.xty + np.array([0.0, 0.0, 0.0, PRIOR * max(jumps, 0.0)]))
        self.slope = (curve(PRIOR_SIZES[-1]) - curve(1)) / (PRIOR_SIZES[-1] - 1)
        self._fit()

    def passes(self, tokens: float) -> int:
        """How many times the kernels go through each weight for ``tokens`` new tokens (1 without blocks)."""
        return max(1, math.ceil(tokens / self.block)) if self.block else 1

    def _x(self, rows: int, tokens: float) -> np.ndarray:
        return np.array([1.0, float(tokens), float(rows - 1), float(self.passes(tokens) - 1)])

    def learn(self, rows: int, tokens: int, seconds: float) -> None:
        """A step of ``rows`` rows over ``tokens`` new tokens whose forward took ``seconds``. A one-row step runs
        compiled, nearly flat in its tokens: it teaches nothing about packed ones."""
        if rows < 2 or tokens < 1 or not seconds > 0:
            return
        x = self._x(rows, tokens)
        self.xtx = FORGET * self.xtx + np.outer(x, x)
        self.xty = FORGET * self.xty + x * seconds
        self._fit()

    def _fit(self) -> None:
        try:
            self.a, self.b, self.c, self.d = np.linalg.solve(self.xtx + self.kept[0], self.xty + self.kept[1]).tolist()
        except np.linalg.LinAlgError:
            return
        self.b, self.d = max(self.b, MIN_SLOPE * self.slope), max(self.d, 0.0)

    def forward(self, rows: int) -> Callable[[float], float]:
        """T -> seconds of a forward holding ``rows`` rows: one row runs compiled, on the one-row curve."""
        return self.curve if rows == 1 else self.cost(rows)

    def cost(self, rows: int) -> Callable[[float], float]:
        """T -> seconds of a packed step of ``rows`` rows over T new tokens (never below the one-row curve)."""
        base = self.a + self.c * (rows - 1)
        return lambda t: max(self.curve(t), base + self.b * t + self.d * (self.passes(t) - 1))
