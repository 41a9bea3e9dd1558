"""What a packed step of several rows costs, learnt from the steps' own times.

The verify cost curve (hydraspec.verify_cost) is measured on one row, and on a CPU a one-row forward of up to
16 tokens runs compiled. A step of several rows (or one row beside a prompt chunk) goes through the model
packed, eagerly, with attention over several caches: it costs more, and its cost grows with every token,
where the compiled curve is nearly flat over some sizes. A drafter that weighs cost against acceptance on
the one-row curve would then verify drafts in a batch that cost more than they give.

:class:`PackedCost` fits seconds = a + b * tokens + c * (rows - 1) by least squares over the recent packed
steps (each older step weighing FORGET times the next), from a prior of the one-row curve's points worth
PRIOR steps in all. Until steps are seen it is the curve; then it follows the machine.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

FORGET = 0.98  # weight of a step relative to the one after it (about the last 50 steps count)
PRIOR = 2.0  # the one-row curve's points count as this many steps in all
PRIOR_SIZES = (2, 4, 8, 16)
MIN_SLOPE = 0.2  # the slope is kept at least this share of the curve's own average slope


class PackedCost:
    """Seconds of a packed step by rows and new tokens: ``cost(rows)`` gives the curve T -> seconds for that
    many rows; :meth:`learn` takes each step's measured forward."""

    def __init__(self, curve: Callable[[float], float]):
        self.curve = curve
        xs = [self._x(1, t) for t in PRIOR_SIZES]
        w = PRIOR / len(PRIOR_SIZES)
        self.xtx = w * sum(np.outer(x, x) for x in xs) + np.diag([0.0, 0.0, PRIOR])  # rows term: prior 0
        self.xty = w * sum(x * curve(t) for x, t in zip(xs, PRIOR_SIZES))
        self.slope = (curve(PRIOR_SIZES[-1]) - curve(1)) / (PRIOR_SIZES[-1] - 1)
        self._fit()

    @staticmethod
    def _x(rows: int, tokens: float) -> np.ndarray:
        return np.array([1.0, float(tokens), float(rows - 1)])

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
            self.a, self.b, self.c = np.linalg.solve(self.xtx, self.xty).tolist()
        except np.linalg.LinAlgError:
            return
        self.b = max(self.b, MIN_SLOPE * self.slope)

    def cost(self, rows: int) -> Callable[[float], float]:
        """T -> seconds of a packed step of ``rows`` rows over T new tokens (never below the one-row curve)."""
        base = self.a + self.c * (rows - 1)
        return lambda t: max(self.curve(t), base + self.b * t)
