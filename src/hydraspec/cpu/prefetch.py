"""How far ahead the 4-bit and GGUF kernels prefetch their weights, chosen on this machine by timing its own
model: the best distance differs between CPUs (docs/cpu-kernels.md, "The weights prefetched 4 KB ahead") and
changes no result, only speed (tests/test_gguf.py).

The first GGUF model loaded on a machine whose weights are far larger than its last-level cache (so that they
stream from memory, as in decoding) is timed at each of :data:`CANDIDATES`: one pass over all its GGUF weights at
1 and at 6 rows, the distances taking turns round by round. The fastest replaces the CPU's known or default
distance (:func:`hydraspec.cpu.kernels.prefetch_bytes`) only where it is at least :data:`GAIN` faster; the choice
is kept in the hydraspec home per CPU model, native build and thread count, so later processes read it.
``HYDRASPEC_PREFETCH_BYTES`` overrides all of this."""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from ..home import keep_json, kept_path
from . import build, kernels
from .gguf import GGUFLinear

CANDIDATES = (1024, 2048, 4096, 8192)
ROWS = (1, 6)  # a decoding step, and a verify step of a few drafts
ROUNDS = 5
GAIN = 0.02  # a distance must beat the prior one by this share to replace it
CACHE_TIMES = 4  # the weights must be this many times the last-level cache to stream from memory


def choose(model: nn.Module) -> int | None:
    """Set the kernels' prefetch distance for this machine (see the module docstring) and return it; None where
    nothing was chosen (an override, no native build, a model too small to time the stream)."""
    lib = kernels.native_lib()
    if os.environ.get("HYDRASPEC_PREFETCH_BYTES") is not None or lib is None or not hasattr(lib, "hs_prefetch_ahead"):
        return None
    path = stored_path()
    chosen = read_choice(path)
    if chosen is None:
        layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
        if sum(weight_bytes(m) for m in layers) < CACHE_TIMES * last_level_cache_bytes():
            return None
        chosen = best(time_distances(layers, lib), kernels.prefetch_bytes())
        write_choice(path, chosen)
    kernels.set_prefetch(lib, chosen)
    return chosen


def best(times: dict[int, dict[int, float]], prior: int) -> int:
    """The distance whose seconds per pass (``times[distance][rows]``), over the prior's and averaged over the
    row counts, are least, if at least :data:`GAIN` below the prior's; else the prior."""
    def ratio(d: int) -> float:
        return statistics.fmean(times[d][r] / times[prior][r] for r in times[prior])

    top = min(times, key=ratio)
    return top if ratio(top) <= 1.0 - GAIN else prior


@torch.inference_mode()
def time_distances(layers: list[GGUFLinear], lib, rounds: int = ROUNDS) -> dict[int, dict[int, float]]:
    """Median seconds of one pass over ``layers`` at each distance in CANDIDATES (and the prior) and each row
    count in ROWS, the distances taking turns in each round, the starting one rotated round by round."""
    dists = sorted(set(CANDIDATES) | {kernels.prefetch_bytes()})
    g = torch.Generator().manual_seed(0)
    xs = {(r, n): torch.randn(r, n, generator=g).to(torch.bfloat16)
          for r in ROWS for n in {m.in_features for m in layers}}
    runs: dict[int, dict[int, list[float]]] = {d: {r: [] for r in ROWS} for d in dists}
    one_pass(layers, xs, ROWS[0])  # warm-up: first calls allocate
    for k in range(rounds):
        for d in dists[k % len(dists):] + dists[:k % len(dists)]:
            kernels.set_prefetch(lib, d)
            for r in ROWS:
                runs[d][r].append(one_pass(layers, xs, r))
    kernels.set_prefetch(lib)
    return {d: {r: statistics.median(v) for r, v in per.items()} for d, per in runs.items()}


def one_pass(layers: list[GGUFLinear], xs: dict, rows: int) -> float:
    t = time.perf_counter()
    for m in layers:
        m(xs[(rows, m.in_features)])
    return time.perf_counter() - t


def weight_bytes(m: GGUFLinear) -> int:
    return sum(b.numel() * b.element_size() for b in m.buffers(recurse=False))


def last_level_cache_bytes() -> int:
    """The largest cache of the first CPU as sysfs gives it (32 MB where it does not)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=32 << 20)


def stored_path() -> Path:
    """Where this machine's choice is kept: named by the CPU, the native build and the thread count."""
    what = [kernels.cpu_identity(), build.library_name(kernels.native_isa()), torch.get_num_threads(), CANDIDATES]
    return kept_path("kernels", what, "prefetch-")


def read_choice(path: Path) -> int | None:
    try:
        value = json.loads(path.read_text())["prefetch_bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and value >= 0 else None


def write_choice(path: Path, nbytes: int) -> None:
    keep_json(path, {"prefetch_bytes": nbytes})
