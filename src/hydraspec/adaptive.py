"""Speculation that follows the load: how many draft tokens each row gets per step.

With R running rows each drafting k tokens, one verify forward holds R (k + 1) tokens and costs c(R (k + 1))
(measured at start-up: one forward over 1, 2, 4, ... 32 new tokens after a short prefix; linear between and
beyond the points). If each drafted token is accepted with probability a given the ones before it, a row
emits on average (1 - a^(k+1)) / (1 - a) tokens per step. The rule picks the k in 0..k_max that maximises
R (1 - a^(k+1)) / (1 - a) / c(R (k + 1)), the expected tokens per second of the whole batch; k = 0 (plain
decoding) wins when the forward's cost grows faster than acceptance pays, and unless drafting is expected to
beat it by PAY_MARGIN (the model leaves out per-row drafting and acceptance work, which grows with the rows).
``a`` is estimated online from the engine's own counts (accepted drafts and misses), starting from a prior
of 0.5 worth 20 draws.
"""
from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from .cache import text_config

PRIOR_RATE, PRIOR_WEIGHT = 0.5, 20.0
PAY_MARGIN = 1.15
SIZES = (1, 2, 4, 8, 16, 32)


@torch.inference_mode()
def measure_verify_cost(model, sizes=SIZES, prefix: int = 64, repeats: int = 3) -> dict[int, float]:
    """Seconds of one target forward over n new tokens after ``prefix`` tokens, best of ``repeats``, made
    non-decreasing in n (a forward over more tokens never costs less; a smaller figure is noise)."""
    dev = model.device
    vocab = text_config(model).vocab_size
    g = torch.Generator().manual_seed(0)
    start = torch.randint(10, min(vocab, 1000), (1, prefix), generator=g).to(dev)
    out = {}
    for n in sizes:
        best = float("inf")
        for _ in range(repeats):
            cache = DynamicCache(config=model.config)
            model(start, past_key_values=cache, use_cache=True, logits_to_keep=1)
            x = torch.randint(10, min(vocab, 1000), (1, n), generator=g).to(dev)
            t = time.perf_counter()
            model(x, past_key_values=cache, use_cache=True)
            best = min(best, time.perf_counter() - t)
        out[n] = max([best] + list(out.values()))
    return out


class AdaptiveDraft:
    """draft_cap(rows) for the engine: the rule of the module docstring over measured costs ``cost``
    ({tokens: seconds}) and the engine's acceptance counts (``engine`` is read at every call)."""

    def __init__(self, cost: dict[int, float], k_max: int, engine=None):
        self.points = sorted(cost.items())
        self.k_max = max(0, int(k_max))
        self.engine = engine
        self.last: dict[int, int] = {}

    def cost(self, n: int) -> float:
        pts = self.points
        if n <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if n <= x1:
                return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return y1 + (y1 - y0) / (x1 - x0) * (n - x1)

    def rate(self) -> float:
        e = self.engine
        acc, miss = (e.accepted_drafts, e.draft_misses) if e is not None else (0, 0)
        return (acc + PRIOR_RATE * PRIOR_WEIGHT) / (acc + miss + PRIOR_WEIGHT)

    def best_k(self, rows: int, a: float | None = None) -> int:
        a = min(self.rate() if a is None else a, 0.999)
        plain = rows / self.cost(rows)
        best, best_k = plain * PAY_MARGIN, 0
        for k in range(1, self.k_max + 1):
            gain = rows * (1 - a ** (k + 1)) / (1 - a) / self.cost(rows * (k + 1))
            if gain > best * 1.0001:
                best, best_k = gain, k
        return best_k

    def __call__(self, rows: int) -> int:
        k = self.best_k(rows)
        self.last[rows] = k
        return k

    def describe(self) -> str:
        costs = ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in self.points)
        ks = ", ".join(f"{r} rows -> {self.best_k(r)}" for r in (1, 2, 4, 8))
        return f"verify cost by tokens {{{costs}}}; acceptance rate {self.rate():.2f}; draft tokens per row: {ks}"
