"""What one target forward over n new tokens costs on this machine: measured once per model and machine
(kept on disk), and read as a curve (linear between the measured sizes and beyond the last two)."""
from __future__ import annotations

import json
import os
import statistics
import time
import weakref
from collections import Counter

import numpy as np
import torch

from . import backend
from .cache import new_cache, text_config
from .home import installed_version, keep_json, kept_path
from .verify import forward_nodes

SIZES = tuple(range(1, 17)) + (20, 24, 32)  # every small size: kernels work in row blocks, so cost is not smooth


_MEASURED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {(sizes, prefix): costs}


PREFIX = 256  # tokens before the timed forwards: about a chat's context, where attention is part of the cost
REPEATS = 5


def stored_cost_path(model, sizes=SIZES, prefix: int = PREFIX, repeats: int = REPEATS):
    """Where the verify cost of this model on this machine is kept between processes (a CPU model only; None
    on other devices): a file named by a hash of everything the timing depends on, the model (class,
    config, dtype, kinds of layers), the machine (CPU model, threads), the native build (which also tells
    an AVX2 CPU from an AVX-512 one) and the sizes. Delete it (or the ``verify-cost`` folder of the
    hydraspec home) to measure again."""
    if model.device.type != "cpu":
        return None
    layers = sorted(Counter(type(m).__name__ for m in model.modules()).items())
    what = [installed_version("hydraspec"), type(model).__name__, model.config.to_json_string(use_diff=False), str(model.dtype), layers,
            getattr(model.config, "_name_or_path", ""), backend.cpu_model(), os.cpu_count(), torch.get_num_threads(),
            backend.build_id(), backend.describe(), list(sizes), prefix, repeats]
    return kept_path("verify-cost", what)


@torch.inference_mode()
def measure_verify_cost(model, sizes=SIZES, prefix: int = PREFIX, repeats: int = REPEATS) -> dict[int, float]:
    """Seconds of one target forward over n new tokens after ``prefix`` tokens (:func:`time_sizes`). A model
    is measured once per process (later calls return the same figures) and once per machine: the figures are
    kept on disk (:func:`stored_cost_path`) and read back by later processes, after a check that one token
    still costs what they say (a machine that was busy when they were taken, or is now, measures again)."""
    key = (tuple(sizes), prefix)
    known = _MEASURED.get(model, {})
    if key in known:
        return dict(known[key])
    path = stored_cost_path(model, sizes, prefix, repeats)
    out = read_stored(path, sizes)
    if out is None or not still_true(model, out, prefix):
        out = time_sizes(model, sizes, prefix, repeats)
        store(path, out)
    _MEASURED.setdefault(model, {})[key] = dict(out)
    return out


def read_stored(path, sizes) -> dict[int, float] | None:
    if path is None or not path.exists():
        return None
    try:
        out = {int(n): float(t) for n, t in json.loads(path.read_text()).items()}
    except (ValueError, OSError, AttributeError):
        return None  # unreadable: measure again
    return out if sorted(out) == sorted(sizes) else None


def store(path, out: dict[int, float]) -> None:
    if path is not None:
        keep_json(path, {str(n): t for n, t in out.items()})


def time_sizes(model, sizes, prefix: int, repeats: int) -> dict[int, float]:
    """The median of ``repeats`` rounds per size, each round taking every size in turn (so a slow spell of the
    machine touches every size alike), then made non-decreasing in n by :func:`monotone` (a forward over more
    tokens never costs less: sizes measured out of order share their mean)."""
    cache, vocab, g = prefilled(model, prefix, max(sizes))
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            times[n].append(forward_seconds(model, cache, prefix, n, vocab, g))
    order = sorted(sizes)
    return dict(zip(order, monotone([statistics.median(times[n]) for n in order])))


def monotone(ys: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``ys`` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m0, c0), (m1, c1) = blocks.pop(-2), blocks.pop()
            blocks.append([(m0 * c0 + m1 * c1) / (c0 + c1), c0 + c1])
    return [m for m, c in blocks for _ in range(c)]


def still_true(model, out: dict[int, float], prefix: int, tolerance: float = 1.5) -> bool:
    """Whether a one-token forward now costs what ``out`` says, within ``tolerance`` either way."""
    cache, vocab, g = prefilled(model, prefix, 1)
    now = min(forward_seconds(model, cache, prefix, 1, vocab, g) for _ in range(3))
    return out[min(out)] / tolerance <= now <= out[min(out)] * tolerance


def prefilled(model, prefix: int, most: int):
    """A cache holding ``prefix`` random tokens (after a warm-up forward, which pays for allocations)."""
    vocab = text_config(model).vocab_size
    g = torch.Generator().manual_seed(0)
    start = torch.randint(10, min(vocab, 1000), (prefix,), generator=g).to(model.device)
    cache = new_cache(model, prefix + most + 4)
    forward_nodes(model, cache, start, torch.arange(prefix, device=model.device), None, 0, last_only=True)
    forward_seconds(model, cache, prefix, 4, vocab, g)
    return cache, vocab, g


def forward_seconds(model, cache, prefix: int, n: int, vocab: int, g) -> float:
    """Seconds of one forward over n random tokens after the ``prefix`` tokens of a :func:`prefilled` cache,
    which is cut back to them after."""
    x = torch.randint(10, min(vocab, 1000), (n,), generator=g).to(model.device)
    positions = torch.arange(prefix, prefix + n, device=model.device)
    t = time.perf_counter()
    forward_nodes(model, cache, x, positions, None, prefix)  # as the engine calls it: the compiled steps apply
    seconds = time.perf_counter() - t
    cache.crop(prefix)
    return seconds


class Curve:
    """Seconds of a verify forward over n tokens from measured points {n: seconds}: linear between them and
    beyond the last two."""

    def __init__(self, points: dict[int, float]):
        self.points = sorted(points.items())

    def __call__(self, n: float) -> float:
        pts = self.points
        if n <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if n <= x1:
                return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return y1 + (y1 - y0) / (x1 - x0) * (n - x1)

    def learn(self, n: int, seconds: float) -> None:
        """Measured points stay as measured (:class:`LearntCurve` follows the steps)."""


class LearntCurve:
    """The one-row curve kept current by the steps' own forwards: each size a step has used gets its steps'
    cost over the measured points (recent steps weighing most, pulled towards 1 as if ``PULL`` steps had cost
    what the points say); a size between used ones gets their ratios interpolated, one beyond them the nearest
    one's; fitted non-decreasing. A step that took far longer than the curve says (a compile, a stall) is left
    out. A machine's pace changes the curve's shape as well as its level (on a shared host, forwards bound by
    arithmetic slow down more than those bound by memory), so the points measured at start-up can misprice
    drafts an hour later."""

    FORGET = 0.98  # weight of a size's step relative to its next one
    PULL = 4.0
    STALL = 3.0  # a step over this many times what the curve says is not learnt from

    def __init__(self, points: dict[int, float]):
        self.base, self.at = Curve(points), dict(points)  # the points, and the curve's value at every size seen
        self.own: dict[int, list[float]] = {}  # size -> discounted sums: cost over the points, steps
        self.curve = self.base

    def __call__(self, n: float) -> float:
        return self.curve(n)

    def learn(self, n: int, seconds: float) -> None:
        """A one-row forward over ``n`` new tokens took ``seconds``."""
        if n < 1 or not 0 < seconds < self.STALL * self.curve(n):  # a compile or a stall says nothing of it
            return
        if n not in self.at:
            self.at[n] = self.base(n)
        own = self.own.setdefault(n, [0.0, 0.0])
        own[0], own[1] = self.FORGET * own[0] + seconds / self.at[n], self.FORGET * own[1] + 1.0
        seen, sizes = sorted(self.own), sorted(self.at)
        ratios = [(self.own[m][0] + self.PULL) / (self.own[m][1] + self.PULL) for m in seen]
        ys = np.interp(sizes, seen, ratios) * [self.at[m] for m in sizes]
        self.curve = Curve(dict(zip(sizes, monotone(ys.tolist()))))
