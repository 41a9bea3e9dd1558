"""Speculation that follows the load: how many draft tokens each row gets per step.

With R running rows each drafting k tokens, one verify forward holds R (k + 1) tokens and costs c(R (k + 1))
(measured at start-up: one forward over 1, 2, 3, ... 16, 20, 24, 32 new tokens after a short prefix; linear
between and beyond the points). If each drafted token is accepted with probability a given the ones before it, a row
emits on average (1 - a^(k+1)) / (1 - a) tokens per step. Before drafting, the rule picks the k in 0..k_max
that maximises R (1 - a^(k+1)) / (1 - a) / c(R (k + 1)), the expected tokens per second of the whole batch;
k = 0 (plain decoding) wins when the forward's cost grows faster than acceptance pays, and unless drafting is
expected to beat it by PAY_MARGIN (the model leaves out per-row drafting and acceptance work, which grows with
the rows). A drafter whose proposals cost next to nothing (prompt lookup) always gets k_max here.

After drafting, :meth:`AdaptiveDraft.widths` cuts each row's actual proposal with each row's own rate a_b
(its own counts, with the engine's rate as prior): where the engine verifies rows packed (each row's nodes
cost only themselves) the i-th draft of row b is worth a_b^i and the rule keeps the drafts worth most as
long as expected tokens per second still grow; with padded rows it picks one common length. So in a full
batch the rows whose lookups keep hitting still draft, and the others cost nothing. ``a`` starts from a
prior of 0.5 worth 20 draws (hydraspec.engine).

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

import hashlib
import json
import os
import time
import weakref
from collections import Counter

import torch

from . import backend
from .cache import new_cache, text_config
from .engine import PRIOR_RATE
from .home import hydraspec_home

PAY_MARGIN = 1.15
PROBE_EVERY, MIN_STEPS, EWMA_STEPS = 10, 8, 32
SIZES = tuple(range(1, 17)) + (20, 24, 32)  # every small size: kernels work in row blocks, so cost is not smooth


_MEASURED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {(sizes, prefix): costs}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hydraspec")
    except PackageNotFoundError:
        return ""


def stored_cost_path(model, sizes=SIZES, prefix: int = 64, repeats: int = 2):
    """Where the verify cost of this model on this machine is kept between processes (a CPU model only; None
    on other devices): a file named by a hash of everything the timing depends on, the model (class,
    config, dtype, kinds of layers), the machine (CPU model, threads), the native build (which also tells
    an AVX2 CPU from an AVX-512 one) and the sizes. Delete it (or the ``verify-cost`` folder of the
    hydraspec home) to measure again."""
    if model.device.type != "cpu":
        return None
    layers = sorted(Counter(type(m).__name__ for m in model.modules()).items())
    what = [_version(), type(model).__name__, model.config.to_json_string(use_diff=False), str(model.dtype), layers,
            getattr(model.config, "_name_or_path", ""), backend.cpu_model(), os.cpu_count(), torch.get_num_threads(),
            backend.build_id(), backend.describe(), list(sizes), prefix, repeats]
    key = hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:24]
    return hydraspec_home() / "verify-cost" / f"{key}.json"


@torch.inference_mode()
def measure_verify_cost(model, sizes=SIZES, prefix: int = 64, repeats: int = 2) -> dict[int, float]:
    """Seconds of one target forward over n new tokens after ``prefix`` tokens, best of ``repeats``, made
    non-decreasing in n (a forward over more tokens never costs less; a smaller figure is noise). The prefix
    is read once and the cache cut back to it after every timed forward; a model is measured once per
    process (later calls return the same figures) and once per machine: the figures are kept on disk
    (:func:`stored_cost_path`) and read back by later processes."""
    key = (tuple(sizes), prefix)
    known = _MEASURED.get(model, {})
    if key in known:
        return dict(known[key])
    path = stored_cost_path(model, sizes, prefix, repeats)
    if path is not None and path.exists():
        try:
            out = {int(n): float(t) for n, t in json.loads(path.read_text()).items()}
            if sorted(out) == sorted(sizes):
                _MEASURED.setdefault(model, {})[key] = dict(out)
                return out
        except (ValueError, OSError, AttributeError):
            pass  # unreadable: measure again
    dev = model.device
    vocab = text_config(model).vocab_size
    g = torch.Generator().manual_seed(0)
    start = torch.randint(10, min(vocab, 1000), (1, prefix), generator=g).to(dev)
    out = {}
    cache = new_cache(model, prefix + max(sizes) + 4)
    model(start, past_key_values=cache, use_cache=True, logits_to_keep=1)
    model(start[:, :4], past_key_values=cache, use_cache=True)  # warm-up: the first forward pays for allocations
    cache.crop(prefix)
    for n in sizes:
        best = float("inf")
        for _ in range(repeats):
            x = torch.randint(10, min(vocab, 1000), (1, n), generator=g).to(dev)
            t = time.perf_counter()
            model(x, past_key_values=cache, use_cache=True)
            best = min(best, time.perf_counter() - t)
            cache.crop(prefix)
        out[n] = max([best] + list(out.values()))
    _MEASURED.setdefault(model, {})[key] = dict(out)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({str(n): t for n, t in out.items()}))
            tmp.replace(path)
        except OSError:
            pass  # a read-only home: measured again next time
    return out


class AdaptiveDraft:
    """draft_cap(rows) for the engine: the rule of the module docstring over measured costs ``cost``
    ({tokens: seconds}) and the engine's acceptance counts (``engine`` is read at every call)."""

    def __init__(self, cost: dict[int, float], k_max: int, engine=None, check: bool = True, cheap: bool = False):
        self.points = sorted(cost.items())
        self.k_max = max(0, int(k_max))
        self.cheap = cheap
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
        return self.engine.rate() if self.engine is not None else PRIOR_RATE

    @property
    def packed(self) -> bool:
        return bool(getattr(self.engine, "packed", False))

    def best_k(self, rows: int, a: float | None = None) -> int:
        a = min(self.rate() if a is None else a, 0.999)
        plain = rows / self.cost(rows)
        best, best_k = plain * PAY_MARGIN, 0
        for k in range(1, self.k_max + 1):
            gain = rows * (1 - a ** (k + 1)) / (1 - a) / self.cost(rows * (k + 1))
            if gain > best * 1.0001:
                best, best_k = gain, k
        return best_k

    def widths(self, rows: int, lengths: list[int], rates: list[float]) -> list[int]:
        """How many of its ``lengths[b]`` proposed nodes row b keeps this step, given each row's acceptance
        rate: the choice with the most expected tokens per second of the verify forward (see the module
        docstring), or none where plain decoding is expected to win by PAY_MARGIN. Packed verification
        (each row's nodes cost only themselves): rows keep different lengths, the i-th draft of row b
        being worth rate_b ** i. Padded: one common length."""
        if not any(lengths):
            return list(lengths)
        rates = [min(max(a, 0.0), 0.999) for a in rates]
        best, keep = rows / self.cost(rows) * PAY_MARGIN, [0] * rows
        if self.packed:
            worth = sorted(((a ** i, b) for b, (a, n) in enumerate(zip(rates, lengths)) for i in range(1, n + 1)),
                           reverse=True)
            value, count = float(rows), 0
            for j, (w, _) in enumerate(worth):
                value += w
                if value / self.cost(rows + j + 1) > best * 1.0001:
                    best, count = value / self.cost(rows + j + 1), j + 1
            for _, b in worth[:count]:
                keep[b] += 1
            return keep
        for m in range(1, max(lengths) + 1):
            value = sum((1 - a ** (min(n, m) + 1)) / (1 - a) for a, n in zip(rates, lengths))
            if value / self.cost(rows * (m + 1)) > best * 1.0001:
                best, keep = value / self.cost(rows * (m + 1)), [min(n, m) for n in lengths]
        return keep

    def __call__(self, rows: int) -> int:
        k = self.k_max if self.cheap else self.best_k(rows)
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
