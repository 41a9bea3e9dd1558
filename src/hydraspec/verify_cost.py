"""What one target forward over n new tokens costs on this machine: measured once per model and machine
(kept on disk), and read as a curve (linear between the measured sizes and beyond the last two)."""
from __future__ import annotations

import hashlib
import json
import os
import time
import weakref
from collections import Counter

import torch

from . import backend
from .cache import cache_kwargs, new_cache, text_config
from .home import hydraspec_home

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
    model(input_ids=start, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    model(input_ids=start[:, :4], **cache_kwargs(model, cache), use_cache=True)  # warm-up: the first forward pays for allocations
    cache.crop(prefix)
    for n in sizes:
        best = float("inf")
        for _ in range(repeats):
            x = torch.randint(10, min(vocab, 1000), (1, n), generator=g).to(dev)
            t = time.perf_counter()
            model(input_ids=x, **cache_kwargs(model, cache), use_cache=True)
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
