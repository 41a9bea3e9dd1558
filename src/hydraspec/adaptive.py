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

The model is then checked against the clock: the engine reports every step's wall time and emitted tokens
(:meth:`AdaptiveDraft.observe`), and per number of rows the rule keeps the tokens per second of the steps that
drafted and of those that did not (averaged over the last ~EWMA_STEPS of each). Where the model says "draft",
one step in PROBE_EVERY decodes plainly instead (one in 4 x PROBE_EVERY once MIN_STEPS are in); once both
sides have MIN_STEPS steps and the drafting steps are measured slower, that row count decodes plainly, still
trying the model's draft length one step in PROBE_EVERY in case acceptance has changed; so does every larger
row count not yet measured itself. So the rule is never slower than plain decoding for long, whatever the
model leaves out (drafting work, Python overhead, padding, a server's own costs).
"""
from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from .cache import text_config

PRIOR_RATE, PRIOR_WEIGHT = 0.5, 20.0
PAY_MARGIN = 1.15
PROBE_EVERY, MIN_STEPS, EWMA_STEPS = 10, 8, 32
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

    def __init__(self, cost: dict[int, float], k_max: int, engine=None, check: bool = True):
        self.points = sorted(cost.items())
        self.k_max = max(0, int(k_max))
        self.engine = engine
        self.check = check
        self.last: dict[int, int] = {}
        # per number of rows: [tokens/s, steps] of drafting steps and of plain ones, and a step counter
        self.measured: dict[int, dict[str, list[float]]] = {}
        self.calls: dict[int, int] = {}

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
        if k and self.check:
            n = self.calls[rows] = self.calls.get(rows, 0) + 1
            if self.drafting_loses(rows):
                k = k if n % PROBE_EVERY == 0 else 0  # measured slower: plain, checking the draft now and then
            else:
                plain = self.measured.get(rows, {}).get("plain", [0.0, 0])[1]
                if n % (PROBE_EVERY if plain < MIN_STEPS else 4 * PROBE_EVERY) == 0:
                    k = 0  # a plain step to compare with (rarer once there are enough)
        self.last[rows] = k
        return k

    def observe(self, rows: int, k: int, seconds: float, tokens: int) -> None:
        """One engine step at ``rows`` rows that drafted up to ``k`` tokens a row took ``seconds`` and emitted
        ``tokens`` tokens."""
        if seconds <= 0:
            return
        side = self.measured.setdefault(rows, {}).setdefault("draft" if k else "plain", [0.0, 0])
        rate, n = side
        w = 1.0 / min(n + 1, EWMA_STEPS)
        side[0], side[1] = rate + w * (tokens / seconds - rate), n + 1

    def _verdict(self, rows: int) -> bool | None:
        m = self.measured.get(rows, {})
        d, p = m.get("draft"), m.get("plain")
        if not (d and p and d[1] >= MIN_STEPS and p[1] >= MIN_STEPS):
            return None
        return d[0] < p[0]

    def drafting_loses(self, rows: int) -> bool:
        """Whether drafting steps at ``rows`` rows were measured slower than plain ones (enough of each); with
        too few steps at ``rows``, whether they were at some smaller row count (a wider batch only makes the
        verify forward's extra tokens cost more)."""
        own = self._verdict(rows)
        if own is not None:
            return own
        return any(self._verdict(r) for r in self.measured if r < rows)

    def describe(self) -> str:
        costs = ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in self.points)
        ks = ", ".join(f"{r} rows -> {self.best_k(r)}" for r in (1, 2, 4, 8))
        text = f"verify cost by tokens {{{costs}}}; acceptance rate {self.rate():.2f}; draft tokens per row: {ks}"
        seen = [f"{r} rows: drafting {m['draft'][0]:.1f} vs plain {m['plain'][0]:.1f} tokens/s"
                for r, m in sorted(self.measured.items()) if "draft" in m and "plain" in m]
        return text + ("; measured " + ", ".join(seen) if seen else "")
