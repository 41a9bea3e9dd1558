"""Timing token trees on the actual device and dtype (`build-tree --select measure`).

A verify step and the drafter's step are timed for a few tree sizes (medians over repeats after a
warm-up), interpolated between them, and the best predicted trees are confirmed by generating on the
calibration prompts. Timing never changes a tree's output, only which tree is chosen.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch

from .. import backend
from ..cache import cache_kwargs, new_cache
from ..drafters.base import DecodeState, Verdict
from ..generator import SpeculativeGenerator
from ..sampling import Sampling
from ..tree import bfs_paths, parents_from_paths, shape_of
from ..verify import forward_nodes, tree_mask


def machine_info(model) -> dict:
    dev = model.device
    info = {"device": str(dev), "dtype": str(model.dtype).removeprefix("torch."), "batch_size": 1,
            "torch_threads": torch.get_num_threads()}
    if dev.type == "cuda":
        info["machine"] = torch.cuda.get_device_name(dev)
    else:
        info["machine"] = f"{backend.cpu_model()} ({os.cpu_count()} cores)"
    return info


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def sample_sizes(n: int) -> list[int]:
    sizes, s = [], 1
    while s < n:
        sizes.append(s)
        s *= 2
    return sizes + [n]


def interpolate(sizes: list[int], values: list[float], n: int) -> float:
    return float(np.interp(n, sizes, values))


def _verify_inputs(order: list[list[int]], n: int, prefix: list[int], seq: list[int]):
    """Tree T_n as one verify step after `prefix` would see it: (paths, shape with the pending token as
    root, token ids [pending + n nodes] taken from `seq`, positions)."""
    L = len(prefix) - 1
    paths = bfs_paths(order[:n])
    parents, _ = parents_from_paths(paths)
    shape = shape_of((-1,) + tuple(p + 1 for p in parents))
    ids = [prefix[-1]] + [seq[(L + 1 + i) % len(seq)] for i in range(n)]
    return paths, shape, ids, L + shape.depth


@torch.inference_mode()
def time_steps(model, make, order: list[list[int]], seq: list[int], plen: int, sizes: list[int],
               reps: int = 5, want_hidden: bool = True,
               accepted: dict[int, int] | None = None) -> dict[int, tuple[float, float]]:
    """{n: (verify seconds, draft seconds)}: the median of `reps` verify forwards over the pending token
    and T_n under its tree mask after the calibration prefix, and of `reps` drafter steps for T_n.
    Between drafter steps the sequence advances as decoding would: `accepted[n]` nodes of the rank-0
    path are accepted (reported to the drafter, so a draft model keeps them cached) plus the target's
    token, so the catch-up work of the next step is part of the timing (default: nothing accepted)."""
    dev = model.device
    prefix = seq[: max(plen, 2)]
    L = len(prefix) - 1
    cache = new_cache(model, len(seq) + max(sizes) + reps + 8)
    _, hid = forward_nodes(model, cache, torch.tensor(prefix[:-1], device=dev), torch.arange(L, device=dev), None, 0,
                           want_hidden=True, last_only=True)
    hidden = hid[-1]
    out = {}
    for n in sizes:
        paths, shape, ids, positions = _verify_inputs(order, n, prefix, seq)
        ids, positions = torch.tensor(ids, device=dev), positions.to(dev)
        anc = None if shape.is_chain else shape.ancestors
        times = []
        for _ in range(reps + 1):
            _sync(dev)
            t0 = time.perf_counter()
            forward_nodes(model, cache, ids, positions, anc, L, want_hidden=want_hidden)
            _sync(dev)
            times.append(time.perf_counter() - t0)
            cache.crop(L)
        verify = float(np.median(times[1:]))
        drafter = make(paths)
        tokens = list(prefix)
        state = DecodeState(tokens=tokens, prompt_len=plen, sampling=Sampling(), hidden=hidden, new_hidden=hid,
                            capacity=len(seq) + max(sizes) + reps + 8)
        index = {tuple(p): i for i, p in enumerate(paths)}
        chain = []  # node indices of the rank-0 path, as deep as T_n holds it
        while (0,) * (len(chain) + 1) in index:
            chain.append(index[(0,) * (len(chain) + 1)])
        acc = chain[: max(0, (accepted or {}).get(n, 0))]
        dtimes = []
        for r in range(reps + 1):
            _sync(dev)
            t0 = time.perf_counter()
            tree = drafter.propose([state])[0]
            _sync(dev)
            dtimes.append(time.perf_counter() - t0)
            drafter.observe([state], [Verdict(list(acc), len(tree))])
            for _ in range(len(acc) + 1):  # the accepted nodes and the target's token, as in decoding
                state.tokens.append(seq[len(state.tokens) % len(seq)])
        out[n] = (verify, float(np.median(dtimes[1:])))
    return out


@torch.inference_mode()
def time_batch_verify(model, order: list[list[int]], seq: list[int], plen: int, sizes: list[int], batch: int,
                      reps: int = 3) -> dict[int, float]:
    """{n: seconds}: the median of `reps` verify forwards of `batch` rows, each holding the pending token
    and T_n under its tree mask after the same calibration prefix (what one step of the batched engine
    costs when every row drafts T_n)."""
    dev = model.device
    prefix = seq[: max(plen, 2)]
    L = len(prefix) - 1
    cache = new_cache(model, L + max(sizes) + 2)
    rows = torch.tensor([prefix[:-1]] * batch, device=dev)
    model(input_ids=rows, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    out = {}
    for n in sizes:
        _, shape, ids, positions = _verify_inputs(order, n, prefix, seq)
        ids = torch.tensor([ids] * batch, device=dev)
        positions = positions.to(dev)[None].expand(batch, -1)
        mask = None if shape.is_chain else tree_mask(L, shape.ancestors, model.dtype, dev).expand(batch, -1, -1, -1)
        times = []
        for _ in range(reps + 1):
            _sync(dev)
            t0 = time.perf_counter()
            model(input_ids=ids, position_ids=positions, attention_mask=mask, **cache_kwargs(model, cache),
                  use_cache=True)
            _sync(dev)
            times.append(time.perf_counter() - t0)
            cache.crop(L)
        out[n] = float(np.median(times[1:]))
    return out


def measure_throughput(model, tokenizer, drafter, prompt_ids: list[list[int]], max_new_tokens: int) -> dict:
    """Greedy generation over the calibration prompts (after one warm-up), as tree.json records it:
    end-to-end tokens/s, tokens/s after the prefill (what the per-step prediction models) and the mean
    tokens per target forward."""
    gen = SpeculativeGenerator(model, tokenizer, drafter)
    gen.generate(input_ids=prompt_ids[0], max_new_tokens=min(8, max_new_tokens))
    toks, forwards, wall, prefill = 0, 0, 0.0, 0.0
    for ids in prompt_ids:
        _sync(model.device)
        t0 = time.perf_counter()
        res = gen.generate(input_ids=ids, max_new_tokens=max_new_tokens)
        _sync(model.device)
        wall += time.perf_counter() - t0
        toks += len(res.token_ids)
        forwards += res.stats.target_forwards
        prefill += res.stats.prefill_s
    return {"measured_tokens_per_s": round(toks / wall if wall > 0 else 0.0, 4),
            "measured_decode_tokens_per_s": round(toks / (wall - prefill) if wall > prefill else 0.0, 4),
            "measured_tokens_per_step": round(toks / forwards if forwards else 0.0, 5)}


__all__ = ["machine_info", "sample_sizes", "interpolate", "time_steps", "time_batch_verify", "measure_throughput"]
